"""The speech study's reduced form through its command line: a few dozen spoken Bible verses,
ASR and both ST arms for 4 updates each, scored and recorded; run again, it reads every run
from its records and trains nothing; --write-docs fills the documents' sections."""

import json
import os

import pytest

from local_attn_fairseq.checkpoint_files import weights_fingerprint

from ..conftest import REPO, run_script
from .speech_corpus import needs_diatheke, needs_espeak

pytestmark = [pytest.mark.slow, needs_espeak, needs_diatheke]

STUDY = os.path.join(REPO, "scripts", "speech_study.py")


def run_study(work, cwd, *options):
    out = run_script(
        STUDY, "--tiny", "--seeds", 1, "--work-dir", work, "--model-dim", 32, *options, cwd=cwd
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_speech_study_trains_scores_records_and_reports(tmp_path):
    work = tmp_path / "speech"
    first = run_study(work, tmp_path)
    records = sorted((work / "records").iterdir())
    assert [r.name.split("-")[4] for r in records] == ["asr", "st_global", "st_local"]
    by_arm = {}
    for path in records:
        record = json.loads(path.read_text())
        by_arm[record["arm"]] = record
        assert record["max_update"] == 4 and record["patience"] == 3 and record["seed"] == 1
        assert len(record["ccd"]) == 6 and all(0 < c <= 1 for c in record["ccd"])
        assert record["validations"] and record["updates_trained"] == 4
    assert by_arm["asr"]["metric"] == "WER" and by_arm["global"]["metric"] == "BLEU"
    assert by_arm["global"]["windows"] == "0,0,0,0,0,0"
    assert by_arm["local"]["windows"] == by_arm["asr"]["chosen_windows"]
    # the ST runs start from the recorded ASR model, named by the fingerprint of its weights
    (asr_dir,) = work.glob("*/runs/asr-*")
    fingerprint = weights_fingerprint(str(asr_dir / "checkpoint_best.pt"))
    assert by_arm["asr"]["weights_fingerprint"] == fingerprint
    encoder = asr_dir / f"encoder_for_st_u{by_arm['asr']['updates_to_convergence']}_{fingerprint}.pt"
    assert weights_fingerprint(str(encoder)) == fingerprint
    for st_dir in work.glob("*/runs/st_*"):
        argv = json.loads((st_dir / "settings.json").read_text())["argv"]
        assert argv[argv.index("--load-pretrained-encoder-from") + 1] == str(encoder)
    # dev and test are spoken by the held-out voice alone
    assert "spoken by spk.en-us-nyc.f5, a voice training never hears" in first

    report = (work / "speech_study.md").read_text()
    assert "<!-- speech study report: start -->" in report
    assert "| ASR (global) | 0,0,0,0,0,0 | WER " in report
    assert "| encoder forward + backward (s) |" in report
    assert (work / "images" / "speech_study_curves.png").stat().st_size > 0
    summary = json.loads(next(work.glob("*/speech_study.json")).read_text())
    assert summary["cost"]["arms"]["local"]["windows"] == by_arm["asr"]["chosen_windows"]
    # every model, and the encoders timed for the cost table, at the width asked for
    assert "at width 32 (FFN 128)" in report and summary["cost"]["embed_dim"] == 32
    run_settings = list(work.glob("*/runs/*/settings.json"))
    assert len(run_settings) == 3
    for settings in run_settings:
        argv = json.loads(settings.read_text())["argv"]
        widths = argv.index("--encoder-embed-dim")
        assert argv[widths : widths + 4] == [
            "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "128"
        ]  # fmt: skip

    # the same command again: every run is read from its record, none trained or scored again
    mtimes = {p: p.stat().st_mtime for p in records}
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "small_scale_study.md").write_text("# Study\n\nkept text\n")
    second = run_study(work, tmp_path, "--write-docs")
    assert "| ST: 2 runs, 2 recorded, 0 to train or score" in second
    assert "fairseq_train" not in second and "fairseq-generate" not in second
    assert {p: p.stat().st_mtime for p in records} == mtimes
    docs = (tmp_path / "docs" / "speech_study.md").read_text()
    assert "## The speech study" in docs
    claims = (tmp_path / "docs" / "small_scale_study.md").read_text()
    assert claims.startswith("# Study\n\nkept text\n")
    assert "<!-- speech study claims: start -->" in claims and "| claim | measured | verdict |" in claims
