"""The speech demo and the speech study's reduced form through their command lines, on one work
folder: ``make demo-speech``'s command on a few dozen spoken Bible verses trains ASR and both
ST arms for 4 updates each (the study's tiny sizes at width 32, one seed: the study's own
runs), scores and records them and prints its table; run again, it trains and scores nothing.
The speech study on the same folder then reads every run from its records, trains nothing,
and writes its report (with --write-docs, the documents' sections too)."""

import json
import os
import re

import pytest
import torch

from local_attn_fairseq.checkpoint_files import weights_fingerprint
from local_attn_fairseq.data.mustc import read_manifest

from ..conftest import REPO, run_script
from .speech_corpus import needs_diatheke, needs_espeak

pytestmark = [pytest.mark.slow, needs_espeak, needs_diatheke]

SPEECH_DEMO = os.path.join("scripts", "demo_speech.py")
STUDY = os.path.join(REPO, "scripts", "speech_study.py")
DEMO_ARGV = ["--quick"]  # the study's --tiny sizes at --model-dim 32, seed 1
STUDY_ARGV = ["--tiny", "--seeds", 1, "--model-dim", 32]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo's work folder and its output, run once as its own process, as a user runs it."""
    work = tmp_path_factory.mktemp("speech_demo") / "speech"
    out = run_script(SPEECH_DEMO, *DEMO_ARGV, "--work-dir", work, separate_process=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return work, out.stdout


def test_speech_demo_runs_end_to_end_and_prints_the_table(demo):
    work, stdout = demo
    results = json.loads((work / "results.json").read_text())
    windows = ",".join(str(w) for w in results["windows"])
    table = stdout[stdout.index("| model |") :]
    assert re.search(r"\| ASR \(global\) \| 0,0,0,0,0,0 \| WER [\d.]+ \|", table)
    global_rows = ["ST, global encoder, before training", "ST, global encoder",
                   "ST, global encoder, test audio shuffled across verses"]  # fmt: skip
    local = "ST, local encoder (Algorithm 1's windows)"
    for model in global_rows:
        assert re.search(rf"\| {re.escape(model)} \| 0,0,0,0,0,0 \| BLEU [\d.]+ \|", table), model
    for model in (local, f"{local}, test audio shuffled across verses"):
        assert f"| {model} | {windows} | BLEU" in table, model
    assert [r["model"] for r in results["rows"]] == ["ASR (global)", *global_rows, local,
                                                     f"{local}, test audio shuffled across verses"]
    assert "Encoder self-attention of the local arm at the mean length" in stdout
    # the shuffled levels are the ST records' own, as the study records them
    st_records = [json.loads(p.read_text()) for p in work.glob("records/*-speech-st_*.json")]
    shuffled_rows = {r["model"]: r["score"] for r in results["rows"] if "shuffled" in r["model"]}
    assert sorted(shuffled_rows.values()) == sorted(r["shuffled_audio_score"] for r in st_records)
    assert (work / "speech_study.md").stat().st_size > 0 and (work / "results.md").exists()
    # not a terminal: plain progress lines while the three models train
    for run in ("ASR, global encoder", "ST, global encoder", re.escape(local)):
        assert re.search(rf"^\| progress \| {run}.*: epoch \d+ \| updates", stdout, re.M), run

    # the untrained level decodes the model the global arm started from: the ASR encoder it
    # loaded, the decoder its seed drew (not the trained one)
    (st_dir,) = work.glob("*/runs/st_global-*")
    initial = torch.load(st_dir / "initial" / "checkpoint_initial.pt", weights_only=False)
    trained = torch.load(st_dir / "checkpoint_best.pt", weights_only=False)
    (encoder_file,) = work.glob("*/runs/asr-*/encoder_for_st_u*.pt")
    asr = torch.load(encoder_file, weights_only=False)["model"]
    layer = "encoder.transformer_layers.0.fc1.weight"
    assert torch.equal(initial["model"][layer], asr[layer])
    assert not torch.equal(initial["model"][layer], trained["model"][layer])
    decoder = "decoder.layers.0.fc1.weight"
    assert not torch.equal(initial["model"][decoder], trained["model"][decoder])
    # the shuffled test set pairs every verse's text with another verse's audio
    (data,) = work.glob("*/data")
    real, shuffled = (read_manifest(data / f"{name}_st.tsv")
                      for name in ("tst-COMMON", "tst-COMMON_shuffled"))  # fmt: skip
    assert [r["tgt_text"] for r in real] == [r["tgt_text"] for r in shuffled]
    assert all(a["audio"] != b["audio"] for a, b in zip(real, shuffled))
    assert sorted(r["audio"] for r in real) == sorted(r["audio"] for r in shuffled)

    # a second run trains and decodes nothing: every run and score is read back
    again = run_script(SPEECH_DEMO, *DEMO_ARGV, "--work-dir", work)  # in this process
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "fairseq_train" not in again.stdout and "fairseq-generate" not in again.stdout
    assert again.stdout[again.stdout.index("| model |") :].split("\n\n")[0] == table.split(
        "\n\n"
    )[0]


def test_the_runs_are_recorded_and_the_st_runs_start_from_the_recorded_asr_model(demo):
    work, _ = demo
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
    # every model at the width asked for
    run_settings = list(work.glob("*/runs/*/settings.json"))
    assert len(run_settings) == 3
    for settings in run_settings:
        argv = json.loads(settings.read_text())["argv"]
        widths = argv.index("--encoder-embed-dim")
        assert argv[widths : widths + 4] == [
            "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "128"
        ]  # fmt: skip


def test_the_speech_study_reads_every_run_from_its_records_and_reports(demo, tmp_path):
    """The study's command on the demo's folder, from a folder with a docs/ of its own."""
    work, _ = demo
    records = sorted((work / "records").iterdir())
    mtimes = {p: p.stat().st_mtime for p in records}
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "small_scale_study.md").write_text("# Study\n\nkept text\n")
    out = run_script(STUDY, *STUDY_ARGV, "--work-dir", work, "--write-docs", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "| ST: 2 runs, 2 recorded, 0 to train or score" in out.stdout
    assert "fairseq_train" not in out.stdout and "fairseq-generate" not in out.stdout
    assert {p: p.stat().st_mtime for p in records} == mtimes
    # dev and test are spoken by the held-out voice alone
    assert "spoken by spk.en-us-nyc.f5, a voice training never hears" in out.stdout

    report = (work / "speech_study.md").read_text()
    assert "<!-- speech study report: start -->" in report
    assert "| ASR (global) | 0,0,0,0,0,0 | WER " in report
    assert "| encoder forward + backward (s) |" in report
    assert (work / "images" / "speech_study_curves.png").stat().st_size > 0
    (asr,) = [json.loads(p.read_text()) for p in records if p.name.split("-")[4] == "asr"]
    summary = json.loads(next(work.glob("*/speech_study.json")).read_text())
    assert summary["cost"]["arms"]["local"]["windows"] == asr["chosen_windows"]
    # the encoders timed for the cost table at the width asked for
    assert "at width 32 (FFN 128)" in report and summary["cost"]["embed_dim"] == 32
    docs = (tmp_path / "docs" / "speech_study.md").read_text()
    assert "## The speech study" in docs
    claims = (tmp_path / "docs" / "small_scale_study.md").read_text()
    assert claims.startswith("# Study\n\nkept text\n")
    assert "<!-- speech study claims: start -->" in claims and "| claim | measured | verdict |" in claims
