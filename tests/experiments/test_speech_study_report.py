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


@pytest.mark.parametrize(
    "seed_ccds, verdict",
    [((0.92, 0.94), "holds"), ((0.85, 0.88), "does not hold"),
     ((0.89, 0.92), "not shown: the seeds fall on both sides of the ASR encoder's CCD")],
)  # fmt: skip
def test_st_more_diagonal_than_asr_needs_every_seed(seed_ccds, verdict):
    """A mean above the ASR encoder's CCD is not enough when one seed's encoder is below it."""
    arms = {arm: report.summarise_arm([st_record(arm, s, 9.0, [c, c])
                                       for s, c in enumerate(seed_ccds, 1)])
            for arm in ("global", "local")}  # fmt: skip
    rows = report.verdicts({"ccd": [0.9, 0.9]}, arms, None)
    assert rows[2][2] == verdict
    assert rows[2][1].endswith(f"(seeds {min(seed_ccds):.3f}-{max(seed_ccds):.3f})")


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


def asr_record():
    layers = [{"window_mean": 1.0, "window_std": 0.5, "contribution_loss_mean": 0.3}] * 2
    return {"score": 38.5, "updates_to_convergence": 15000, "converged": False, "ccd": [0.9, 0.95],
            "contributions": layers, "chosen_windows": "0,13"}  # fmt: skip


def rendered(arms):
    from types import SimpleNamespace

    split = {"utterances": 10, "hours": 0.1, "speakers": ["a"]}
    facts = {"train": dict(split, speakers=["b"]), "dev": split, "tst-COMMON": split}
    sizes = SimpleNamespace(max_words=25, model_dim=128, vocab=1000, asr_max_update=15000,
                            st_max_update=12000)  # fmt: skip
    settings = {"patience": 3, "command": "speech_study.py", "machine": "2 CPU cores",
                "training_hours": 1.0}  # fmt: skip
    return report.report(facts, sizes, settings, asr_record(), arms, None, "curves.png")


def tables(markdown):
    """Each Markdown table of the text as a list of its rows' cell counts."""
    found, current = [], []
    for line in markdown.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line.strip().strip("|").count("|") + 1)
        elif current:
            found.append(current)
            current = []
    return found


@pytest.mark.parametrize("arms", [(), ("global",), ("global", "local")])
def test_every_table_of_the_report_is_well_formed_as_runs_arrive(arms):
    """With the ASR run alone, then one ST arm, then both: every row of a table has the
    header's columns, and the claims table appears only with rows to show."""
    summaries = {arm: report.summarise_arm([st_record(arm, 1, 8.0, [0.97, 0.99])]) for arm in arms}
    markdown = rendered(summaries)
    shapes = tables(markdown)
    assert shapes and all(len(set(shape)) == 1 and len(shape) > 2 for shape in shapes), shapes
    assert ("| claim | measured | verdict |" in markdown) == (len(arms) == 2)
    if len(arms) < 2:
        assert "The claim is judged once both ST arms have a run recorded." in markdown
