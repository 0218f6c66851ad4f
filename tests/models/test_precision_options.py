"""--bf16 and --fp16 where fairseq 0.12 would crash: a clear error before training."""

import argparse

import pytest
import torch
from fairseq import utils as fairseq_utils

from local_attn_fairseq.models.precision_check import check_training_precision, precision_problem

from ..conftest import TINY_MODEL, TRAIN, USER_DIR, fairseq_cli

NO_XLA = getattr(fairseq_utils, "xm", None) is None


def options(**given):
    defaults = dict(bf16=False, fp16=False, cpu=False, fp16_no_flatten_grads=False)
    return argparse.Namespace(**{**defaults, "memory_efficient_fp16": False, **given})


def train(data, save_dir, *extra):
    """fairseq-train as a user types it; returns the finished process, whatever its status."""
    return fairseq_cli(
        "fairseq-train", data / "bin", "--user-dir", USER_DIR, "--arch", "transformer_local",
        *TINY_MODEL, *TRAIN, "--max-update", 1, "--save-dir", save_dir, *extra, check=False,
    )  # fmt: skip


def test_which_options_fairseq_cannot_train_with():
    assert "torch_xla" in precision_problem(options(bf16=True), True, False)
    assert precision_problem(options(bf16=True), True, True) is None  # a TPU host
    assert "--fp16-no-flatten-grads" in precision_problem(options(fp16=True), False, False)
    assert "--fp16-no-flatten-grads" in precision_problem(options(fp16=True, cpu=True), True, False)
    assert precision_problem(options(fp16=True), True, False) is None  # on a GPU
    assert precision_problem(options(fp16=True, fp16_no_flatten_grads=True), False, False) is None
    assert precision_problem(options(fp16=True, memory_efficient_fp16=True), False, False) is None
    assert precision_problem(options(), False, False) is None


def test_models_loaded_outside_fairseq_train_are_not_checked():
    # a checkpoint trained with --fp16 on a GPU stores fp16=True; generating on a CPU is fine
    check_training_precision(options(fp16=True, bf16=True))


@pytest.mark.skipif(not NO_XLA, reason="with torch_xla, --bf16 trains on a TPU")
def test_bf16_without_torch_xla_is_refused_before_training(tiny_data, tmp_path):
    proc = train(tiny_data, tmp_path, "--bf16")
    assert proc.returncode != 0
    assert "--bf16 (and --memory-efficient-bf16) turns on --tpu" in proc.stderr
    assert "xla_device" not in proc.stderr  # fairseq's own crash is never reached
    assert not (tmp_path / "checkpoint_last.pt").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="--fp16 trains on the GPU")
def test_fp16_on_a_cpu_asks_for_no_flatten_grads(tiny_data, tmp_path):
    proc = train(tiny_data, tmp_path, "--fp16")
    assert proc.returncode != 0
    assert "--fp16 on a CPU needs --fp16-no-flatten-grads" in proc.stderr
    assert "NVIDIA driver" not in proc.stderr
