"""Resuming fairseq-train: the stored model is rebuilt, and checkpoints survive a killed save."""

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from fairseq import checkpoint_utils
from fairseq.models import MODEL_REGISTRY

from local_attn_fairseq.models.locality_options import add_locality_args
from local_attn_fairseq.models.resume_check import model_options

from ..conftest import TINY_MODEL, TRAIN, USER_DIR, fairseq_cli, train_tiny
from .helpers import build_model

FIRST3 = ["identity", "identity", "prev-1", "prev-2", "next-1", "next-2", "band-1", "band-2"]


def stored_state(path):
    return checkpoint_utils.load_checkpoint_to_cpu(str(path))


def stored_updates(path):
    return stored_state(path)["optimizer_history"][-1]["num_updates"]


def encoder_heads(path):
    """The head tokens of every encoder layer of the model a checkpoint rebuilds."""
    models, _ = checkpoint_utils.load_model_ensemble([str(path)])
    return [[h.token for h in layer.self_attn.head_specs] for layer in models[0].encoder.layers]


def log_of(proc):
    return proc.stdout + proc.stderr


def test_resume_without_locality_options_keeps_the_stored_spec(tiny_data, tmp_path):
    train_tiny(tiny_data, tmp_path, "--locality-config", "8loc-first3", max_update=2)
    resumed = train_tiny(tiny_data, tmp_path, max_update=3)
    assert "no locality options given" in log_of(resumed)
    assert "--locality-config: stored spec '8loc-first3'" in log_of(resumed)
    last = tmp_path / "checkpoint_last.pt"
    assert stored_updates(last) == 3
    assert json.loads(stored_state(last)["cfg"]["model"].locality_config)["name"] == "8loc-first3"
    heads = encoder_heads(last)
    assert heads[:3] == [FIRST3] * 3 and heads[3] == ["global"] * 8


def test_resume_with_other_locality_options_is_refused(tiny_data, tmp_path):
    train_tiny(tiny_data, tmp_path, "--locality-config", "8loc-first3", max_update=2)
    refused = fairseq_cli(
        "fairseq-train", tiny_data / "bin", "--user-dir", USER_DIR, "--arch", "transformer_local",
        *TINY_MODEL, *TRAIN, "--max-update", 4, "--save-dir", tmp_path,
        "--locality-config", "8loc-last3", "--localness-layers", "encoder_self:4-5",
        check=False,
    )  # fmt: skip
    assert refused.returncode != 0
    message = log_of(refused)
    assert "--locality-config: stored spec '8loc-first3', given '8loc-last3'" in message
    assert "--localness-layers: stored None, given 'encoder_self:4-5'" in message
    assert "new --save-dir" in message and "--reset-optimizer" in message
    assert stored_updates(tmp_path / "checkpoint_last.pt") == 2  # nothing trained
    # only fairseq-train compares: building a model elsewhere reads no checkpoint
    model, _, _ = build_model(
        tiny_data / "bin", "transformer_local", *TINY_MODEL, "--save-dir", tmp_path,
        "--locality-config", "8loc-last3",
    )  # fmt: skip
    assert model.encoder.layers[5].self_attn.head_specs[7].token == "band-2"


def test_every_model_option_of_the_plugin_is_compared():
    parser = argparse.ArgumentParser()
    add_locality_args(parser)
    locality = {a.dest for a in parser._actions} - {"help"}
    for name in ("transformer_local", "roberta_local"):
        assert set(model_options(MODEL_REGISTRY[name])) == locality, name
    lm = set(model_options(MODEL_REGISTRY["transformer_lm_local"]))
    assert lm == locality | {"decoder_post_norm"}
    assert set(model_options(MODEL_REGISTRY["s2t_transformer_local"])) == {
        "encoder_attention_windows"
    }


def test_resume_with_the_same_spec_given_another_way(tiny_data, tmp_path):
    train_tiny(tiny_data, tmp_path, "--locality-config", "8loc-first3", max_update=2)
    inline = "{name: same, encoder_self: {0-2: [" + ", ".join(FIRST3) + "]}}"
    resumed = train_tiny(tiny_data, tmp_path, "--locality-config", inline, max_update=3)
    assert "no locality options given" not in log_of(resumed)
    assert stored_updates(tmp_path / "checkpoint_last.pt") == 3


def test_resume_after_the_spec_file_is_deleted(tiny_data, tmp_path):
    spec_file = tmp_path / "mine.yaml"
    spec_file.write_text("name: mine\nencoder_self:\n  0-2: [" + ", ".join(FIRST3) + "]\n")
    save_dir = tmp_path / "ckpt"
    train_tiny(tiny_data, save_dir, "--locality-config", spec_file, max_update=2)
    spec_file.unlink()
    resumed = train_tiny(tiny_data, save_dir, "--locality-config", spec_file, max_update=3)
    assert f"{spec_file}: no such file" in log_of(resumed)
    last = save_dir / "checkpoint_last.pt"
    assert stored_updates(last) == 3
    assert json.loads(stored_state(last)["cfg"]["model"].locality_config)["name"] == "mine"
    assert encoder_heads(last)[0] == FIRST3


def test_truncated_checkpoint_last_falls_back_to_the_newest_intact(tiny_data, tmp_path):
    train_tiny(tiny_data, tmp_path, "--save-interval-updates", 1, max_update=2)
    last = tmp_path / "checkpoint_last.pt"
    data = last.read_bytes()
    last.write_bytes(data[: len(data) // 2])
    resumed = train_tiny(tiny_data, tmp_path, "--save-interval-updates", 1, max_update=3)
    log = log_of(resumed)
    assert f"{last} cannot be read" in log and "Resuming from" in log
    assert "newest intact checkpoint" in log and "@ 2 updates" in log
    assert stored_updates(last) == 3


def test_a_run_killed_before_its_first_checkpoint_last_resumes_from_its_checkpoint(
    tiny_data, tmp_path
):
    train_tiny(tiny_data, tmp_path, "--save-interval-updates", 1, max_update=2)
    earlier = tmp_path / "checkpoint_1_2.pt"
    for path in glob.glob(str(tmp_path / "checkpoint*.pt")):
        if path != str(earlier):  # as if killed right after the first file of the save at 2
            os.unlink(path)
    before = earlier.read_bytes()
    resumed = train_tiny(tiny_data, tmp_path, "--save-interval-updates", 1, max_update=3)
    log = log_of(resumed)
    assert "checkpoint_last.pt does not exist" in log and f"Resuming from {earlier}" in log
    assert "@ 2 updates" in log  # fairseq loaded it: not a run from scratch
    assert stored_updates(tmp_path / "checkpoint_last.pt") == 3
    assert earlier.read_bytes() == before


def test_no_intact_checkpoint_is_a_clear_error(tiny_data, tmp_path):
    train_tiny(tiny_data, tmp_path, max_update=1)
    for path in glob.glob(str(tmp_path / "checkpoint*.pt")):
        with open(path, "r+b") as f:
            f.truncate(100)
    failed = train_tiny_unchecked(tiny_data, tmp_path, max_update=2)
    assert failed.returncode != 0
    assert "no other checkpoint in" in log_of(failed) and "can be read" in log_of(failed)
    assert os.path.getsize(tmp_path / "checkpoint_last.pt") == 100  # left as it was


def train_tiny_unchecked(data, save_dir, *extra, max_update):
    return fairseq_cli(
        "fairseq-train", data / "bin", "--user-dir", USER_DIR, "--arch", "transformer_local",
        *TINY_MODEL, *TRAIN, "--max-update", max_update, "--save-dir", save_dir, *extra,
        check=False,
    )  # fmt: skip


def test_finetuning_into_other_parameter_shapes_is_refused(tiny_data, tmp_path):
    train_tiny(tiny_data, tmp_path / "base", max_update=1)
    base = tmp_path / "base" / "checkpoint_last.pt"
    same_shapes = train_tiny(
        tiny_data, tmp_path / "local", "--locality-config", "8loc-first3",
        "--finetune-from-model", base, max_update=2,
    )  # fmt: skip
    log = log_of(same_shapes)
    assert "fine-tuning from" in log and "other locality options" in log
    tied = train_tiny_unchecked(
        tiny_data, tmp_path / "tied", "--locality-config", "1loc7tied-all6",
        "--finetune-from-model", base, max_update=2,
    )  # fmt: skip
    assert tied.returncode != 0
    assert "parameters have other shapes" in log_of(tied)
    assert "encoder.layers.0.self_attn" in log_of(tied)


# Runs fairseq-train in this process after making the N-th checkpoint write (a copy to
# checkpoint_last, or a torch.save) stop half way and wait to be killed.
STALLING_TRAINER = r"""
import io, os, shutil, sys, time
import torch
import local_attn_fairseq  # noqa: F401  (the shims, as --user-dir applies them)
from fairseq_cli.train import cli_main

stall_in, stall_at, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]
seen = [0]

def stall(write_half):
    seen[0] += 1
    if seen[0] == stall_at:
        write_half()
        open(marker, "w").close()
        time.sleep(600)
    return False

real_copyfile, real_save = shutil.copyfile, torch.save

def copyfile(src, dst, *args, **kwargs):
    if "checkpoint_last" in os.path.basename(dst):
        def write_half():
            data = open(src, "rb").read()
            with open(dst, "wb") as out:
                out.write(data[: len(data) // 2]); out.flush(); os.fsync(out.fileno())
        stall(write_half)
    return real_copyfile(src, dst, *args, **kwargs)

def save(obj, f, *args, **kwargs):
    def write_half():
        buffer = io.BytesIO(); real_save(obj, buffer)
        f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2]); f.flush(); os.fsync(f.fileno())
    if hasattr(f, "write"):
        stall(write_half)
    return real_save(obj, f, *args, **kwargs)

if stall_in == "copy":
    shutil.copyfile = copyfile
else:
    torch.save = save
sys.argv = ["fairseq-train", *sys.argv[4:]]
cli_main()
"""


@pytest.mark.parametrize("stall_in", ["copy", "write"])
def test_killed_save_leaves_only_loadable_checkpoints(tiny_data, tmp_path, stall_in):
    save_dir, marker = tmp_path / "ckpt", tmp_path / "stalled"
    args = [
        tiny_data / "bin", "--user-dir", USER_DIR, "--arch", "transformer_local", *TINY_MODEL,
        *TRAIN, "--max-update", 3, "--save-interval-updates", 1, "--save-dir", save_dir,
    ]  # fmt: skip
    # the second save: checkpoint_last.pt of the first one must survive the kill
    cmd = [sys.executable, "-c", STALLING_TRAINER, stall_in, "2", str(marker), *map(str, args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    output = proc.communicate()[0]
    assert marker.exists(), output[-3000:]
    checkpoints = sorted(glob.glob(str(save_dir / "checkpoint*.pt")))
    assert str(save_dir / "checkpoint_last.pt") in checkpoints
    for path in checkpoints:
        stored_state(path)  # every file under a checkpoint name loads
    assert stored_updates(save_dir / "checkpoint_last.pt") == 1
    partial = glob.glob(str(save_dir / ".checkpoint*.pt.*.tmp"))
    assert len(partial) == 1  # the half-written file, under its temporary name
    (save_dir / ".notes.txt.0123abcd.tmp").write_text("a user's")  # not a checkpoint's name
    resumed = train_tiny(tiny_data, save_dir, "--save-interval-updates", 1, max_update=3)
    assert "@ 1 updates" in log_of(resumed)
    assert f"removed {partial[0]}, a partial checkpoint" in log_of(resumed)
    assert stored_updates(save_dir / "checkpoint_last.pt") == 3
    assert glob.glob(str(save_dir / ".*.tmp")) == [str(save_dir / ".notes.txt.0123abcd.tmp")]
