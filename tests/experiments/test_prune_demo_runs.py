"""The pruning demo's fine-tunings are keyed by every setting they depend on: a run with another
--log-alpha-init trains its own, never reusing (and mislabelling) another value's."""

import os

import pytest

from local_attn_fairseq.experiments import prune_demo

from .test_demo_inputs import Recorder


@pytest.fixture(autouse=True)
def no_demo_epochs(monkeypatch):
    monkeypatch.delenv("DEMO_EPOCHS", raising=False)


def test_fine_tunings_with_other_gate_initialisations_are_other_runs(tmp_path, monkeypatch):
    runs = Recorder(monkeypatch)
    monkeypatch.setattr(prune_demo, "pruned_checkpoint", lambda gated, out: (out, 8))
    argv = ["--work-dir", str(tmp_path / "demo_runs"), "--max-train", "100", "--lambdas", "0.1"]
    fine_tunings = {}
    for init in ("1", "0.5", "1.0"):
        runs.saved.clear()
        prune_demo.main(argv + ["--log-alpha-init", init])
        baseline, gated = runs.saved
        assert gated.startswith(baseline + os.sep)
        fine_tunings[init] = gated
    assert fine_tunings["1"] == fine_tunings["1.0"] != fine_tunings["0.5"]
    assert os.path.basename(fine_tunings["0.5"]) == "lambda0.1_ft3_init0.5"
