"""The speech encoder's training memory at long lengths: no T x T term in an all-local encoder,
measured as the long-context benchmark measures an LM's (peaks at three lengths, their T^2
coefficient), and the memory report's rule: measured under the cap, estimated and not run
over it."""

import pytest

from local_attn_fairseq.experiments import speech_encoder_cost
from local_attn_fairseq.experiments.speech_encoder_cost import (
    FRAMES_PER_SECOND,
    build_encoder,
    memory_growth,
    memory_report,
    memory_table,
)
from local_attn_fairseq.models.s2t_transformer_local import s2t_transformer_local_tiny

from ..conftest import run_script

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALL_LOCAL, ALL_GLOBAL = "3,3,5,5,7,7", "0,0,0,0,0,0"
LAYERS, HEADS = 6, 4
PROBES = (4, 8, 12)  # seconds: 100 to 300 encoder frames
MiB = 2**20


def tiny_encoder(windows):
    encoder, _ = build_encoder(windows, arch=s2t_transformer_local_tiny)
    return encoder


def test_an_all_local_encoder_trains_without_a_t_squared_term():
    """The global encoder keeps each head's float32 attention weights for its backward (at
    least 4 bytes x heads x layers per T^2); the all-local one nothing that grows as T^2."""
    local, _ = memory_growth(tiny_encoder(ALL_LOCAL), 1, probe_seconds=PROBES)
    dense, _ = memory_growth(tiny_encoder(ALL_GLOBAL), 1, probe_seconds=PROBES)
    assert dense >= 4 * HEADS * LAYERS
    assert local < 1.0


def test_memory_report_measures_what_fits_and_only_estimates_the_rest(monkeypatch):
    """At a cap between the two encoders' needs at 40 s: the global encoder is measured at
    20 s and never run at 40 s (reported with its estimate); the local one is measured at both,
    its estimates close to what it then takes."""
    encoders = {"global": tiny_encoder(ALL_GLOBAL), "local": tiny_encoder(ALL_LOCAL)}
    runs = []
    training_peak = speech_encoder_cost.training_peak

    def recorded(encoder, frames, *args):
        runs.append((encoder, frames))
        return training_peak(encoder, frames, *args)

    monkeypatch.setattr(speech_encoder_cost, "training_peak", recorded)
    cap = 150 * MiB  # the global encoder needs ~0.1 GiB at 20 s, ~0.3 at 40 s
    report = memory_report(encoders, [40, 20], 1, cap, probe_seconds=PROBES)
    dense, local = report["global"], report["local"]
    assert [(p.seconds, p.encoder_frames) for p in dense] == [(20, 500), (40, 1000)]
    assert dense[0].fits and not dense[1].fits and dense[1].estimated_bytes > cap
    assert (encoders["global"], 40 * FRAMES_PER_SECOND) not in runs
    assert dense[0].peak_bytes == pytest.approx(dense[0].estimated_bytes, rel=0.15)
    assert all(p.fits for p in local)
    for point in local:
        assert point.peak_bytes == pytest.approx(point.estimated_bytes, rel=0.1)
        assert point.peak_bytes < dense[0].peak_bytes
    rows = memory_table(report, cap)
    assert rows[3].startswith("| 40 s | 4000 | 1000 | does not fit (est. ")


def test_the_benchmark_reports_memory_instead_of_time():
    proc = run_script(
        "benchmarks/speech_encoder.py", "--arch", "s2t_transformer_local_tiny", "--windows",
        ALL_LOCAL, "--batch", 1, "--memory-seconds", 30, "--memory-cap-gb", 0.05,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = [line for line in proc.stdout.splitlines() if line.startswith("| 30 s |")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1:3] == ["3000", "750"]
    assert cells[3].startswith("does not fit") and cells[4] == "-"
    assert cells[5].endswith(")") and float(cells[6]) > 0  # the local encoder measured
    refused = run_script("benchmarks/speech_encoder.py", "--memory-seconds", 30,
                         "--memory-cap-gb", 0)  # fmt: skip
    assert refused.returncode == 2
    assert "--memory-cap-gb: must be above 0, got 0" in refused.stderr
