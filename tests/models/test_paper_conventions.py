"""The papers' conventions and their authors' code, one option apart, through fairseq-train:
the options are stored in the checkpoint, rebuild the same model, and an older checkpoint
without them loads with the papers' conventions."""

import json
import math
import re

import pytest
import torch
from fairseq import checkpoint_utils

from ..conftest import train_tiny
from local_attn_fairseq.analysis.localness import localness_windows

AUTHORS_CODE = (
    "--head-gates", "enc", "--head-gate-init", "glorot", "--head-gate-temperature", 0.33,
    "--criterion", "label_smoothed_cross_entropy_l0", "--l0-lambda", 0.01,
    "--l0-penalty-scale", "per-layer-mean",
    "--localness-layers", "encoder_self:0-1", "--localness-centre", "code",
)  # fmt: skip
ENCODER_LAYERS = 6
HEADS = 8


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    """Two updates with every authors'-code option; the log and the checkpoint."""
    save_dir = tmp_path_factory.mktemp("authors_code")
    proc = train_tiny(tiny_data, save_dir, *AUTHORS_CODE)
    return proc.stdout + proc.stderr, save_dir / "checkpoint_last.pt"


def load(checkpoint):
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([str(checkpoint)])
    return models[0].eval(), task


def valid_batch(task):
    task.load_dataset("valid")
    dataset = task.dataset("valid")
    return dataset.collater([dataset[i] for i in range(12)])


def test_options_are_stored_in_the_checkpoint(trained):
    _, checkpoint = trained
    state = checkpoint_utils.load_checkpoint_to_cpu(str(checkpoint))
    spec = json.loads(state["cfg"]["model"].locality_config)
    assert spec["head_gates"]["init"] == "glorot"
    assert spec["localness"]["centre"] == "code"
    assert state["cfg"]["criterion"]["l0_penalty_scale"] == "per-layer-mean"


def test_glorot_gates_took_effect(trained):
    _, checkpoint = trained
    model, _ = load(checkpoint)
    gates = [layer.self_attn.head_gates for layer in model.encoder.layers]
    assert all(g is not None and g.init == "glorot" for g in gates)
    log_alpha = torch.cat([g.log_alpha.detach() for g in gates])
    # U(-b, b), b = sqrt(3 / 8) = 0.61, moved by two Adam steps of 1e-3 at most
    assert log_alpha.abs().max() < math.sqrt(3 / HEADS) + 0.003
    assert log_alpha.std() > 0.2  # a constant start would still be within 0.003 of 3.0


def test_per_layer_mean_penalty_took_effect(trained):
    """The validation line logs the penalty lambda multiplies: the mean over the 6 gated
    encoder layers of their L_C, which the loaded model gives again."""
    log, checkpoint = trained
    model, _ = load(checkpoint)
    logged = re.findall(r"valid on 'valid' subset \|.*?\| l0_penalty ([\d.]+)", log)
    assert logged, log[-3000:]
    mean = model.head_gate_penalty("per-layer-mean").item()
    assert float(logged[-1]) == pytest.approx(mean, abs=0.006)
    total = model.head_gate_penalty().item()
    assert total == pytest.approx(ENCODER_LAYERS * mean) and float(logged[-1]) < HEADS


def test_code_centre_took_effect(trained):
    """Yang et al.'s code convention: the centre reaches the last real token, never past it."""
    _, checkpoint = trained
    model, task = load(checkpoint)
    sample = valid_batch(task)
    assert model.encoder.layers[0].self_attn.localness.centre == "code"
    windows = localness_windows(model, sample)
    assert sorted(windows) == [("encoder_self", 0), ("encoder_self", 1)]
    lengths = sample["net_input"]["src_lengths"]
    for found in windows.values():
        last_real = (lengths - 1).float()[:, None, None]
        assert (found["centre"] <= last_real + 1e-5).all()


def test_a_checkpoint_without_the_options_loads_with_the_papers_conventions(trained, tmp_path):
    _, checkpoint = trained
    state = torch.load(checkpoint, weights_only=False)
    args = state["cfg"]["model"]
    spec = json.loads(args.locality_config)
    del spec["head_gates"]["init"], spec["localness"]["centre"]
    args.locality_config = json.dumps(spec)
    del args.head_gate_init, args.localness_centre
    state["cfg"]["criterion"].pop("l0_penalty_scale")
    old = tmp_path / "old.pt"
    torch.save(state, old)
    model, _ = load(old)
    assert model.encoder.layers[0].self_attn.localness.centre == "paper"
    assert model.encoder.layers[0].self_attn.head_gates.init == "constant"
    # the stored gate values are loaded all the same
    stored = state["model"]["encoder.layers.0.self_attn.head_gates.log_alpha"]
    assert torch.equal(model.encoder.layers[0].self_attn.head_gates.log_alpha.detach(), stored)
