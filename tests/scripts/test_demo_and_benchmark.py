"""The demo and the benchmark end to end, reduced to a smoke run (small training set, 1 epoch)."""

import json
import os
import re
import subprocess
import sys

import pytest

from ..conftest import REPO

pytestmark = pytest.mark.slow


def test_demo_runs_end_to_end_and_prints_the_table(tmp_path):
    work = tmp_path / "demo"
    cmd = [
        sys.executable,
        os.path.join(REPO, "scripts", "demo.py"),
        "--work-dir",
        work,
        "--epochs",
        "1",
        "--max-train",
        "1500",
        "--vocab-size",
        "1000",
    ]
    out = subprocess.run(list(map(str, cmd)), capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    table = out.stdout[out.stdout.index("| model |") :]
    assert re.search(r"\| transformer \(baseline\) \| 0\.\d+M \| [\d.]+ \| \d+ \|", table)
    assert re.search(r"\| transformer_local_tied \| 0\.\d+M \| [\d.]+ \| \d+ \|", table)
    rows = json.loads((work / "results.json").read_text())["rows"]
    base, tied = rows
    assert tied["encoder_attention_params"] < base["encoder_attention_params"]
    assert all(r["train_words_per_s"] > 0 for r in rows)
    # a second run finds everything done and only prints the table again
    again = subprocess.run(list(map(str, cmd)), capture_output=True, text=True)
    assert again.returncode == 0 and "fairseq-train" not in again.stdout


def test_benchmark_prints_the_ratio(tmp_path):
    work = tmp_path / "bench"
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "benchmarks", "training_throughput.py"),
            "--work-dir",
            str(work),
            "--rounds",
            "2",
            "--batches",
            "3",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    match = re.search(
        r"ratio transformer_local_tied / transformer \(baseline\): ([\d.]+)", out.stdout
    )
    assert match and float(match.group(1)) > 0
    # tied Wq/Wk are projected once for all the heads that share them: fewer matrix products
    ceiling = re.search(r"FLOP ratio .*: ([\d.]+); measured / ceiling", out.stdout)
    assert ceiling and float(ceiling.group(1)) > 1.05, out.stdout[-2000:]
