"""The study's reduced form through its command line: a thousand Ding sentence pairs, two tiny
models (the baseline and the gated one, scored after pruning) trained side by side, one seed, a
cap of 4 updates, then a cap of 8 that continues the same runs, then the same study in another
folder that reads the runs from the first one's records."""

import json
import os
import re

import pytest

from ..conftest import REPO, run_script

pytestmark = pytest.mark.slow

STUDY = os.path.join("scripts", "small_scale_study.py")
TRACKED_REPORT = os.path.join(REPO, "docs", "small_scale_study.md")


def run_study(work, max_update, *options, separate_process=False):
    """The study's script (in this process unless `separate_process`: its trainings run as
    their own processes either way)."""
    out = run_script(
        STUDY, "--work-dir", work, "--corpus", "ding-de-en", "--tiny", "--max-train", 1000,
        "--test-size", 20, "--vocab-size", 400, "--seeds", 1, "--models", "baseline,gates_l0",
        "--jobs", 2, "--max-update", max_update, *options, separate_process=separate_process,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def scores(report_json):
    """{model: [(BLEU, validation curve) per seed]} of a study's JSON report."""
    corpora = json.loads(report_json.read_text())["corpora"]
    return {
        name: [(r["bleu"], r["validations"]) for r in model["runs"]]
        for corpus in corpora
        for name, model in corpus["models"].items()
    }


def test_study_resumes_its_runs_and_reports_to_the_work_folder(tmp_path):
    work = tmp_path / "study"
    first = run_study(work, 4, separate_process=True)
    runs = sorted((work / "ding-de-en" / "runs").iterdir())
    assert [r.name.split("-")[0] for r in runs] == ["baseline", "gates_l0"]
    # not a terminal: plain progress lines, one per run
    assert re.search(r"^\| progress \| transformer \(baseline\) \[baseline-\w+\]: epoch \d+ \| "
                     r"updates \d+/4 \| loss ", first, re.M)  # fmt: skip
    assert "\r" not in first

    second = run_study(work, 8)
    assert sorted((work / "ding-de-en" / "runs").iterdir()) == runs  # the same runs, continued
    for run in runs:
        log = (run / "train.log").read_text()
        assert re.search(r"Loaded checkpoint \S+checkpoint_last\.pt \(epoch \d+ @ 4 updates\)", log)
        assert log.count("done training in") == 2
        assert '"valid_num_updates": "8"' in log
    study = json.loads((work / "small_scale_study.json").read_text())
    baseline = study["corpora"][0]["models"]["baseline"]
    assert baseline["updates_trained"] == 8 and len(baseline["runs"]) == 1
    # the gated model is scored after its closed heads are pruned
    (ding,) = study["corpora"]
    assert ding["corpus"] == "ding-de-en" and set(ding["models"]) == {"baseline", "gates_l0"}
    gated = ding["models"]["gates_l0"]
    assert len(gated["runs"]) == 1 and len(gated["encoder_heads_kept"]) == 1
    walls = [v["wall"] for v in baseline["runs"][0]["validations"]]
    assert walls == sorted(walls) and walls[0] > 0  # wall time keeps counting across sessions
    assert "| transformer (baseline) |" in second and "updates to convergence" in second
    assert "2 runs side by side" in second and "--max-update 8" in second

    # a third call finds both runs finished: nothing is trained or scored again
    third = run_study(work, 8)
    assert third.count("reused") == 2 and "fairseq_train" not in third
    assert "fairseq-generate" not in third

    # another folder (another machine) given the records: the runs are read, not trained
    records = sorted(p.name for p in (work / "records").iterdir())
    assert [r.split("-seed1-")[0] for r in records] == ["ding-de-en-baseline", "ding-de-en-gates_l0"]
    elsewhere = tmp_path / "elsewhere"
    fourth = run_study(elsewhere, 8, "--records", work / "records")
    assert fourth.count("reused") == 2 and "fairseq_train" not in fourth
    assert "fairseq-generate" not in fourth and not (elsewhere / "ding-de-en" / "runs").exists()
    assert "2 runs read from records of earlier runs of the study" in fourth
    assert scores(elsewhere / "small_scale_study.json") == scores(work / "small_scale_study.json")
    # a study in progress reports what is recorded and trains nothing
    partial = tmp_path / "partial_records"
    partial.mkdir()
    (partial / records[0]).write_bytes((work / "records" / records[0]).read_bytes())
    progress = run_study(elsewhere, 8, "--records", partial, "--report-only")
    assert "fairseq_train" not in progress and "fairseq-generate" not in progress
    assert "**A study in progress:** 1 of 2 runs recorded" in progress
    assert "| transformer (baseline) |" in progress and "| encoder head gates" not in progress
    # a smaller budget is another study: its runs are not the recorded ones
    smaller = run_study(elsewhere, 4, "--records", work / "records", "--report-only")
    assert "2 runs, 0 recorded, 2 to train or score" in smaller

    report = (work / "small_scale_study.md").read_text()
    assert "images/small_scale_study_ding-de-en.png" in report
    assert (work / "images" / "small_scale_study_ding-de-en.png").read_bytes()[:4] == b"\x89PNG"
    with open(TRACKED_REPORT, encoding="utf-8") as f:
        assert str(work) not in f.read()  # the tracked report is written only on request
