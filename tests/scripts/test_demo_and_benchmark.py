"""The text demo and the benchmarks end to end, reduced to a smoke run (small training set, 1
epoch); the speech demo: test_speech_study.py, which shares its runs."""

import json
import os
import re
import subprocess
import sys
from datetime import datetime, timedelta

import pytest
import torch

from local_attn_fairseq.experiments.measurement import attention_traffic_bytes, band_flops

from ..conftest import REPO, run_script

pytestmark = pytest.mark.slow

DEMO = os.path.join("scripts", "demo.py")
THROUGHPUT = os.path.join("benchmarks", "training_throughput.py")


def test_demo_runs_end_to_end_and_prints_the_table(tmp_path):
    """``make demo``'s command with its default corpus, the Bible, on a slice of it."""
    work = tmp_path / "demo"
    argv = ["--work-dir", work, "--epochs", "1", "--max-train", "600", "--test-size", "20"]
    argv += ["--vocab-size", "1000"]
    out = run_script(DEMO, *argv, separate_process=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # not a terminal: plain progress lines (no bar), the last one of each model says done
    for model in (r"transformer \(baseline\)", "transformer_local_tied"):
        assert re.search(
            rf"^\| progress \| {model}: epoch 1 \| updates \d+ \| loss [\d.]+ \| \d+ words/s \| done$",
            out.stdout,
            re.M,
        ), out.stdout[-3000:]
    assert "\r" not in out.stdout
    assert "Bible en-es (WEB / Reina-Valera 1909) test (20 sentences), 1 epochs" in out.stdout
    table = out.stdout[out.stdout.index("| model |") :]
    assert re.search(r"\| transformer \(baseline\) \| 0\.\d+M \| [\d.]+ \| \d+ \|", table)
    assert re.search(r"\| transformer_local_tied \| 0\.\d+M \| [\d.]+ \| \d+ \|", table)
    results = json.loads((work / "bible-en-es" / "results.json").read_text())
    assert results["corpus"] == "bible-en-es"
    rows = results["rows"]
    base, tied = rows
    assert tied["encoder_attention_params"] < base["encoder_attention_params"]
    assert all(r["train_words_per_s"] > 0 for r in rows)
    # a second run finds everything done and only prints the table again
    again = run_script(DEMO, *argv)  # in this process: no second Python start
    assert again.returncode == 0 and "fairseq-train" not in again.stdout


def test_benchmark_prints_the_ratio(tmp_path):
    work = tmp_path / "bench"
    out = run_script(
        THROUGHPUT, "--work-dir", work, "--rounds", 2, "--batches", 3, separate_process=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    match = re.search(
        r"ratio transformer_local_tied / transformer \(baseline\): ([\d.]+)", out.stdout
    )
    assert match and float(match.group(1)) > 0
    # tied Wq/Wk are projected once for all the heads that share them: fewer matrix products
    ceiling = re.search(r"FLOP ratio .*: ([\d.]+); measured / ceiling", out.stdout)
    assert ceiling and float(ceiling.group(1)) > 1.05, out.stdout[-2000:]
    # Pande's masks for all heads of a layer in one comparison: few operations beyond the baseline
    operations = re.search(r"operations per batch .*: (\d+) vs (\d+), ([\d.]+)x", out.stdout)
    assert operations and 1.0 <= float(operations.group(3)) < 1.15, out.stdout[-2000:]


@pytest.mark.parametrize("option", ["--fp16", "--bf16"])
def test_benchmark_refuses_half_precision_on_the_cpu(tmp_path, option):
    out = run_script(THROUGHPUT, option, "--work-dir", tmp_path / "bench")
    assert out.returncode == 2
    assert f"{option} needs --device cuda" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "bench").exists()  # refused before any data preparation


def test_kernel_benchmark_prints_every_route(tmp_path):
    table = tmp_path / "table.md"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "banded_attention.py")]
    cmd += ["--lengths", "64", "--widths", "5", "--repeats", "1", "--backward"]
    out = subprocess.run(cmd + ["--output", str(table)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {line.split(" | ")[3]: line for line in table.read_text().splitlines()
            if line.startswith("| 64 | 5 | fwd+bwd |")}  # fmt: skip
    assert set(rows) == {"banded", "blocked", "flex", "sdpa", "naive", "global"}
    assert "no CPU backward" in rows["flex"]
    for name in ("banded", "blocked", "sdpa", "naive", "global"):
        ms, tflops = rows[name].split(" | ")[4], rows[name].split(" | ")[9]
        assert float(ms) > 0 and float(tflops) > 0, rows[name]


RECORD_FIGURES = (
    "ms", "band_tflops", "hbm_gbps", "peak_mib", "mib_beyond_outputs",
)  # fmt: skip
RECORD_KEYS = {
    "gpu", "torch", "date", "dtype", "banded_impl", "repeats", "matmul_peak_tflops",
    "B", "H", "D", "T", "w", "mode", "route", "band_flops", "hbm_bytes",
    "speedup_vs_banded", "speedup_vs_global", "note", *RECORD_FIGURES,
}  # fmt: skip


def test_kernel_benchmark_writes_one_record_per_table_row(tmp_path):
    table, written = tmp_path / "table.md", tmp_path / "results" / "cpu.json"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "banded_attention.py")]
    cmd += ["--lengths", "64", "--widths", "5", "--repeats", "1", "--modes", "fwd+bwd"]
    cmd += ["--batch", "1", "--heads", "2", "--dim", "16"]
    cmd += ["--output", str(table), "--json", str(written)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split(" | ") for line in table.read_text().splitlines()
            if line.startswith("| 64 | 5 |")]  # fmt: skip
    records = json.loads(written.read_text())
    assert os.listdir(written.parent) == ["cpu.json"]  # the temporary name is gone
    assert isinstance(records, list)
    assert [(r["T"], r["w"], r["mode"], r["route"]) for r in records] == [
        (64, 5, "fwd+bwd", row[3]) for row in rows
    ]
    flops = band_flops(1, 2, 64, 5, 16, backward=True)
    traffic = attention_traffic_bytes(1, 2, 64, 16, 4, backward=True)
    for record, row in zip(records, rows):
        assert set(record) == RECORD_KEYS, record
        assert record["gpu"].startswith("CPU, ") and " threads" in record["gpu"]
        assert record["torch"] == torch.__version__
        assert datetime.fromisoformat(record["date"]).utcoffset() == timedelta(0)
        assert (record["dtype"], record["B"], record["H"], record["D"]) == ("float32", 1, 2, 16)
        assert (record["banded_impl"], record["repeats"]) == ("extension", 1)
        assert record["band_flops"] == flops and record["hbm_bytes"] == traffic
        if record["note"] is None:
            assert all(isinstance(record[k], float) for k in RECORD_FIGURES), record
            assert min(record[k] for k in ("ms", "band_tflops", "hbm_gbps")) > 0, record
            assert record["peak_mib"] >= record["mib_beyond_outputs"] >= 0, record
            seconds = record["ms"] / 1e3
            assert record["band_tflops"] == pytest.approx(flops / seconds / 1e12)
            assert record["hbm_gbps"] == pytest.approx(traffic / seconds / 1e9)
            assert row[4] == f"{record['ms']:.2f}" and row[7] == f"{record['peak_mib']:.1f}"
        else:
            assert isinstance(record["note"], str) and row[4] == record["note"]
            assert all(record[k] is None for k in RECORD_FIGURES), record
    by_route = {record["route"]: record for record in records}
    assert by_route["flex"]["note"] == "no CPU backward"
    banded, naive = by_route["banded"], by_route["naive"]
    assert banded["speedup_vs_banded"] == 1.0 and by_route["global"]["speedup_vs_global"] == 1.0
    assert naive["speedup_vs_banded"] == pytest.approx(banded["ms"] / naive["ms"])


def test_gpu_checks_refuse_a_machine_without_a_gpu(tmp_path):
    script = os.path.join(REPO, "benchmarks", "gpu_checks.sh")
    usage = subprocess.run(["bash", script], capture_output=True, text=True)
    assert usage.returncode == 2 and "usage: bash benchmarks/gpu_checks.sh" in usage.stderr
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the checks would run")
    env = dict(os.environ, PYTHON=sys.executable)
    out = subprocess.run(
        ["bash", script, str(tmp_path / "gpu")], capture_output=True, text=True, env=env
    )
    assert out.returncode == 1 and "sees no CUDA device" in out.stderr
    assert os.listdir(tmp_path / "gpu") == ["summary.txt"]  # no step started, nothing logged
