"""``make demo-lm``'s command end to end in its smoke form (``--quick``: a few hundred verses, a
tiny model, 20 updates each), then run again: finished runs reused, an interrupted one resumed."""

import json
import math
import os
import re
import shutil

import pytest
import torch

from ..conftest import run_script

pytestmark = pytest.mark.slow

LM_DEMO = os.path.join("scripts", "demo_lm.py")
MODELS = ("transformer_lm (baseline)", "transformer_lm_local, every head local-16")
ROW = re.compile(
    r"^\| (?P<model>[^|]+) \| (?P<updates>\d+) \| (?P<wps>\d+) \| (?P<valid>[\d.]+) \| "
    r"(?P<test>[\d.]+) \| (?P<ms>[\d.]+) \|$",
    re.M,
)


def commands(stdout, tool):
    """The command lines of ``tool`` the demo printed as it ran them."""
    return re.findall(rf"^\$ \S*{tool} .*$", stdout, re.M)


def table_of(stdout):
    return stdout[stdout.index("| model |") : stdout.index("Prompt (")]


def interrupt_after_first_save(run_dir):
    """The state a run killed just after its save at update 10 leaves: that checkpoint as its
    last, and its log up to that save."""
    (saved,) = run_dir.glob("checkpoint_*_10.pt")
    shutil.copyfile(saved, run_dir / "checkpoint_last.pt")
    log = (run_dir / "train.log").read_text()
    end = log.index("\n", log.index(f"Saved checkpoint {saved}"))
    (run_dir / "train.log").write_text(log[: end + 1])


def test_lm_demo_trains_scores_and_continues_then_reuses_and_resumes_its_runs(tmp_path):
    work = tmp_path / "demo"
    argv = ["--quick", "--work-dir", work]
    out = run_script(LM_DEMO, *argv, separate_process=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # not a terminal: plain progress lines, the last one of each model says done
    for model in MODELS:
        assert re.search(
            rf"^\| progress \| {re.escape(model)}: epoch \d+ \| updates 20/20 \| loss [\d.]+ \| "
            r"\d+ words/s \| done$",
            out.stdout,
            re.M,
        ), out.stdout[-3000:]
    table = table_of(out.stdout)
    rows = [match.groupdict() for match in ROW.finditer(table)]
    assert [row["model"] for row in rows] == list(MODELS), table
    for row in rows:
        assert row["updates"] == "20" and int(row["wps"]) > 0 and float(row["ms"]) > 0
        assert all(1 < float(row[s]) < 300 for s in ("valid", "test")), row  # under 300 pieces
    results = json.loads((work / "bible-lm" / "results.json").read_text())
    assert results["prompt"].startswith("Now after the death of Moses")  # Joshua 1:1, held out
    for row in results["rows"]:
        assert math.isfinite(row["valid_perplexity"]) and math.isfinite(row["test_perplexity"])
        assert len(row["continuation"].split()) >= 3
        assert f"{row['model']}:\n... {row['continuation']}" in out.stdout
    heading, body = (work / "bible-lm" / "results.md").read_text().split("\n\n", 1)
    assert f"\n{heading}, " in out.stdout and body in out.stdout  # printed with the minutes

    # the two models differ in their heads only: the same parameters, pre-norm layers
    runs = [next((work / "bible-lm").glob(f"data_*/runs/{arch}-*"))
            for arch in ("transformer_lm", "transformer_lm_local")]  # fmt: skip
    states = [torch.load(run / "checkpoint_last.pt", weights_only=False) for run in runs]
    base, local = ({k: tuple(v.shape) for k, v in s["model"].items()} for s in states)
    assert base == local
    configs = [s["cfg"]["model"] for s in states]  # a dict (fairseq's model), a Namespace
    configs = [c if isinstance(c, dict) else vars(c) for c in configs]
    assert [c["decoder_normalize_before"] for c in configs] == [True, True]

    # a second run trains, scores and decodes nothing: it prints the same table
    again = run_script(LM_DEMO, *argv)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    for tool in ("fairseq-train", "fairseq-eval-lm", "fairseq-interactive"):
        assert not commands(again.stdout, tool), tool
    assert all(f"| {model}: finished in " in again.stdout for model in MODELS)
    assert table_of(again.stdout) == table

    # the local model's training killed after its save at update 10: it continues from there
    local_run = runs[1]
    interrupt_after_first_save(local_run)
    resumed = run_script(LM_DEMO, *argv)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    (trained,) = commands(resumed.stdout, "fairseq-train")
    assert "--arch transformer_lm_local " in trained
    assert f"| {MODELS[0]}: finished in " in resumed.stdout
    log = (local_run / "train.log").read_text()
    assert re.search(r"Loaded checkpoint \S+checkpoint_last\.pt \(epoch \d+ @ 10 updates\)", log)
    rows = [match.groupdict() for match in ROW.finditer(table_of(resumed.stdout))]
    assert [row["updates"] for row in rows] == ["20", "20"]
    # the resumed model's scores and continuation only
    assert len(commands(resumed.stdout, "fairseq-eval-lm")) == 2
    assert len(commands(resumed.stdout, "fairseq-interactive")) == 1
