"""Precision options fairseq 0.12 cannot train with on this machine, refused before training.

fairseq turns ``--bf16`` into ``--tpu`` and then asks torch_xla for its device, so without
torch_xla (on a CPU or a GPU) the trainer stops with ``'NoneType' object has no attribute
'xla_device'``; ``--fp16`` on a CPU makes its flattened float32 copy on CUDA unless
``--fp16-no-flatten-grads`` is given. The plugin's models check this when fairseq-train builds
them, so the user gets the reason and the fix instead of a traceback.
"""

from typing import Optional

import torch
from fairseq import utils as fairseq_utils

from ..checkpoint_files import current_fairseq_train_run


def precision_problem(args, cuda_available: bool, xla_available: bool) -> Optional[str]:
    """Why fairseq-train would crash with these precision options, or None."""
    if getattr(args, "bf16", False) and not xla_available:
        return (
            "--bf16 (and --memory-efficient-bf16) turns on --tpu in fairseq 0.12 and needs "
            "torch_xla, which is not installed: fairseq-train cannot train in bfloat16 on a CPU "
            "or a GPU. Use --fp16 or --amp on a GPU (on a CPU: --fp16 --fp16-no-flatten-grads), "
            "or float32 (no option)"
        )
    on_cpu = getattr(args, "cpu", False) or not cuda_available
    flattened_fp16 = getattr(args, "fp16", False) and not (
        getattr(args, "fp16_no_flatten_grads", False)
        or getattr(args, "memory_efficient_fp16", False)
    )
    if on_cpu and flattened_fp16:
        return (
            "--fp16 on a CPU needs --fp16-no-flatten-grads with fairseq 0.12 (its flattened "
            "float32 copy of the parameters is made on CUDA): add it, or train on a GPU"
        )
    return None


def check_training_precision(args) -> None:
    """Raise ValueError when fairseq-train is building the model with options it would crash on;
    models built by anything else (fairseq-generate, analysis tools) are not checked."""
    if current_fairseq_train_run() is None:
        return
    xla_available = getattr(fairseq_utils, "xm", None) is not None
    problem = precision_problem(args, torch.cuda.is_available(), xla_available)
    if problem:
        raise ValueError(problem)
