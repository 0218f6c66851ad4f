"""The speech study's report: verdicts and summaries, from records as the study writes them."""

import pytest

from local_attn_fairseq.experiments import speech_study_report as report


def st_record(arm, seed, score, ccd, windows=None, shuffled=None):
    windows = windows or ("0,0,0,0,0,0" if arm == "global" else "0,0,3,5,5,7")
    record = {"arm": arm, "seed": seed, "score": score, "ccd": ccd, "converged": True,
              "updates_to_convergence": 1000 * seed, "windows": windows}  # fmt: skip
    if shuffled is not None:
        record["shuffled_audio_score"] = shuffled
    return record


def test_summarise_arm_averages_seeds_and_layers():
    records = [st_record("global", 1, 8.0, [0.9, 0.8]), st_record("global", 2, 10.0, [0.7, 0.6])]
    summary = report.summarise_arm(records)
    assert summary["mean"] == 9.0 and summary["std"] == pytest.approx(2**0.5)
    assert summary["ccd"] == pytest.approx([0.8, 0.7])
    assert summary["updates_to_convergence"] == 1500 and summary["converged"] == 2


def cost(local_flops):
    return {"arms": {"global": {"flops_at_mean": 100.0}, "local": {"flops_at_mean": local_flops}},
            "mean_encoder_frames": 160}  # fmt: skip


@pytest.mark.parametrize(
    "local_bleu, verdict", [(9.1, "holds"), (8.0, "holds"), (7.9, "does not hold")]
)
def test_the_claim_holds_within_one_bleu_of_the_global_arm(local_bleu, verdict):
    asr = {"ccd": [0.8, 0.8]}
    arms = {
        "global": report.summarise_arm([st_record("global", s, 9.0, [0.9, 0.9])
                                              for s in (1, 2)]),
        "local": report.summarise_arm([st_record("local", s, local_bleu, [0.9, 0.9])
                                             for s in (1, 2)]),
    }  # fmt: skip
    rows = report.verdicts(asr, arms, cost(20.0))
    assert rows[0][2] == verdict
    assert rows[1][2] == "met"  # the global arm reaches 8 BLEU
    assert rows[2][2] == "holds"  # ST more diagonal than ASR
    assert rows[3][1].startswith("0.20x") and rows[3][2] == "met"


def test_one_seed_makes_the_verdict_provisional_and_weak_models_are_named():
    asr = {"ccd": [0.95]}
    arms = {arm: report.summarise_arm([st_record(arm, 1, 2.0, [0.9])])
            for arm in ("global", "local")}  # fmt: skip
    rows = report.verdicts(asr, arms, cost(60.0))
    assert rows[0][2] == "holds; provisional: one seed"
    assert rows[1][2].startswith("not met")
    assert rows[2][2] == "does not hold"
    assert rows[3][2] == "not met"


def test_no_window_chosen_leaves_the_claim_untested():
    arms = {arm: report.summarise_arm([st_record(arm, s, 5.0, [0.9], "0,0,0,0,0,0")
                                             for s in (1, 2)])
            for arm in ("global", "local")}  # fmt: skip
    rows = report.verdicts({"ccd": [0.8]}, arms, None)
    assert rows[0][2].startswith("not tested: Algorithm 1 chose no window")
    assert len(rows) == 3  # no cost measured, no cost row


def test_the_shuffled_audio_level_is_reported_beside_the_test_score():
    arms = {arm: report.summarise_arm([st_record(arm, s, 9.0, [0.9], shuffled=s * 0.5)
                                       for s in (1, 2)])
            for arm in ("global", "local")}  # fmt: skip
    assert arms["global"]["shuffled"] == pytest.approx(0.75)
    rows = report.verdicts({"ccd": [0.8]}, arms, None)
    assert rows[1][1] == "BLEU 9.00 (0.75 on the test audio shuffled across verses)"
    # records written before they held the level: the column stays empty, nothing breaks
    old = {arm: report.summarise_arm([st_record(arm, 1, 9.0, [0.9])])
           for arm in ("global", "local")}  # fmt: skip
    assert report.verdicts({"ccd": [0.8]}, old, None)[1][1] == "BLEU 9.00"
