"""Voita et al.'s workflow through fairseq's CLI: train, fine-tune with gates and the L0
criterion, prune the closed heads out of the checkpoint, generate from the pruned model."""

import os
import subprocess
import sys

import pytest
import torch
from fairseq import checkpoint_utils

from ..conftest import REPO, run_script, train_tiny
from .helpers import build_model, generate

SPEC = ("--locality-config", "1loc7tied-all6", "--localness-layers", "encoder_self:1")
FINETUNE = (
    "--head-gates", "enc,dec,cross", "--criterion", "label_smoothed_cross_entropy_l0",
    "--l0-lambda", "2", "--head-gate-log-alpha-init", "0.5", "--lr", "0.05", "--max-update", "6",
)  # fmt: skip
# Chosen closed gates: layer 0 head 0 owns the Wq/Wk every other encoder head uses; layer 1 has
# Gaussian heads (whose projections read all queries); layer 3 loses every head.
CLOSED = {
    "encoder.layers.0.self_attn": [0, 5],
    "encoder.layers.1.self_attn": [1, 2, 3, 7],
    "encoder.layers.3.self_attn": list(range(8)),
    "decoder.layers.1.self_attn": [0, 1, 2],
    "decoder.layers.0.encoder_attn": [4, 5, 6, 7],
}


def prune(checkpoint, output):
    script = os.path.join(REPO, "scripts", "prune_heads.py")
    proc = subprocess.run(
        [sys.executable, script, checkpoint, output], capture_output=True, text=True, check=True
    )
    return proc.stdout


def hypotheses(proc):
    """(id, text, score) of every detokenized hypothesis."""
    found = []
    for line in proc.stdout.splitlines():
        if line.startswith("D-"):
            ident, score, text = line.split("\t", 2)
            found.append((ident, text, float(score)))
    return sorted(found)


def assert_same_hypotheses(ours, theirs):
    """Same texts; scores equal up to float32 rounding (a pruned layer multiplies smaller
    matrices, whose sums may round differently in the last bits)."""
    ours, theirs = hypotheses(ours), hypotheses(theirs)
    assert [h[:2] for h in ours] == [h[:2] for h in theirs]
    assert all(abs(a[2] - b[2]) <= 1e-4 for a, b in zip(ours, theirs))


def test_finetune_with_gates_then_prune_and_generate(tiny_data, tmp_path):
    base, gated_dir = tmp_path / "base", tmp_path / "gated"
    train_tiny(tiny_data, base, *SPEC, max_update=3)
    proc = train_tiny(
        tiny_data, gated_dir, *SPEC, *FINETUNE, "--freeze-decoder",
        "--finetune-from-model", base / "checkpoint_last.pt",
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    assert "l0_penalty" in log and "open_enc" in log and "open_cross" in log
    before = checkpoint_utils.load_checkpoint_to_cpu(str(base / "checkpoint_last.pt"))["model"]
    after = checkpoint_utils.load_checkpoint_to_cpu(str(gated_dir / "checkpoint_last.pt"))["model"]
    # Gates moved; the frozen decoder did not (its embeddings are the encoder's, and train).
    assert not torch.allclose(after["encoder.layers.2.self_attn.head_gates.log_alpha"],
                              torch.full((8,), 0.5))  # fmt: skip
    for name, value in before.items():
        if name.startswith("decoder.") and "embed" not in name and "output_projection" not in name:
            assert torch.equal(after[name], value), name
    assert not torch.equal(
        after["encoder.layers.2.fc1.weight"], before["encoder.layers.2.fc1.weight"]
    )

    # Close a chosen pattern of gates in the checkpoint, prune, and compare translations.
    state = torch.load(gated_dir / "checkpoint_last.pt", weights_only=False)
    for module, heads in CLOSED.items():
        log_alpha = state["model"][f"{module}.head_gates.log_alpha"]
        log_alpha.fill_(1.0)
        log_alpha[heads] = -1.0
    torch.save(state, tmp_path / "gated.pt")
    report = prune(tmp_path / "gated.pt", tmp_path / "pruned.pt")
    assert "encoder_self     48 ->   34 heads" in report, report
    # its own earlier output too is replaced only when the user says so
    assert run_prune(tmp_path / "gated.pt", tmp_path / "pruned.pt").returncode == 2
    again = run_prune(tmp_path / "gated.pt", tmp_path / "pruned.pt", "--overwrite")
    assert again.returncode == 0 and "48 ->   34 heads" in again.stdout, again.stderr

    pruned = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "pruned.pt"))["model"]
    assert pruned["encoder.layers.3.self_attn.out_proj.weight"].shape == (32, 0)
    assert pruned["encoder.layers.1.self_attn.v_proj.weight"].shape == (4 * 4, 32)
    assert pruned["encoder.layers.0.self_attn.q_proj.weight"].shape == (4, 32)  # head 0's Wq kept
    assert not any("head_gates" in k for k in pruned)
    assert sum(v.numel() for v in pruned.values()) < sum(v.numel() for v in state["model"].values())
    gated_out = generate(tiny_data, tmp_path / "gated.pt")
    pruned_out = generate(tiny_data, tmp_path / "pruned.pt")
    assert_same_hypotheses(pruned_out, gated_out)


def test_pruned_shape_trains_from_scratch(tiny_data, tmp_path):
    kept = "{encoder_self: [2, 1, 0, 8, 8, 3], decoder_cross: [[1, 6], 8]}"
    train_tiny(tiny_data, tmp_path, "--heads-kept", kept)
    generate(tiny_data, tmp_path / "checkpoint_last.pt")
    model, _, _ = build_model(tiny_data / "bin", "transformer_local", "--heads-kept", kept,
                              "--encoder-layers", 6, "--decoder-layers", 2)  # fmt: skip
    heads = [layer.self_attn.num_heads for layer in model.encoder.layers]
    assert heads == [2, 1, 0, 8, 8, 3]
    assert model.decoder.layers[0].encoder_attn.kept_heads == [1, 6]


def test_prune_refuses_a_checkpoint_without_gates(trained_checkpoint, tmp_path):
    proc = run_prune(trained_checkpoint, tmp_path / "out.pt")
    assert proc.returncode != 0 and "has no head gates" in proc.stderr


def run_prune(*args):
    """scripts/prune_heads.py in this process (prune() above runs it as a process of its own)."""
    return run_script(os.path.join("scripts", "prune_heads.py"), *args)


def assert_one_line_error(proc, *expected):
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    # fairseq's import may log a line of its own (a missing optional package): not an error
    lines = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and lines[0].startswith("prune_heads.py: error:"), proc.stderr
    for text in expected:
        assert text in lines[0]


def test_prune_refuses_to_replace_a_file_it_was_not_told_to(trained_checkpoint, tmp_path):
    thesis = tmp_path / "thesis.txt"
    thesis.write_text("three years of work")
    proc = run_prune(trained_checkpoint, thesis)
    assert_one_line_error(proc, str(thesis), "--overwrite")
    assert thesis.read_text() == "three years of work" and os.listdir(tmp_path) == ["thesis.txt"]
    # with --overwrite the file may be replaced: the run goes on to the checkpoint's own check
    proc = run_prune(trained_checkpoint, thesis, "--overwrite")
    assert_one_line_error(proc, "has no head gates")
    assert thesis.read_text() == "three years of work" and os.listdir(tmp_path) == ["thesis.txt"]


@pytest.mark.parametrize(
    "broken, expected",
    [
        ("missing", "no such checkpoint file"),
        ("empty", "the file is empty"),
        ("truncated", "truncated or not a checkpoint"),
    ],
)
def test_prune_names_an_unreadable_checkpoint(trained_checkpoint, tmp_path, broken, expected):
    checkpoint = tmp_path / f"{broken}.pt"
    if broken == "empty":
        checkpoint.write_bytes(b"")
    elif broken == "truncated":
        whole = trained_checkpoint.read_bytes()
        checkpoint.write_bytes(whole[: len(whole) // 2])
    proc = run_prune(checkpoint, tmp_path / "pruned.pt")
    assert_one_line_error(proc, str(checkpoint), expected)
    assert not (tmp_path / "pruned.pt").exists()
