"""fairseq-train's checkpoint files: written atomically, and the one a run resumes from.

fairseq 0.12 writes a checkpoint once and then copies it, in place, to its other names
(``checkpoint_best.pt``, ``checkpoint_last.pt``), so a run killed during a copy leaves a
truncated file under a final name. The writers here put every file under a temporary name in
the same folder and rename it into place. When ``checkpoint_last.pt`` cannot be read anyway (a
crash of the file system, a copy by hand), a resumed run starts from the newest intact
checkpoint of the save folder instead; the unreadable file itself is never touched here.
"""

import contextlib
import copy
import glob
import hashlib
import logging
import os
import shutil
import zipfile
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .file_safety import atomic_output, remove_leftover_temporaries

logger = logging.getLogger(__name__)

DEFAULT_RESTORE_FILE = "checkpoint_last.pt"  # fairseq's default --restore-file


class UnreadableCheckpointError(RuntimeError):
    """A checkpoint file that is truncated, empty or not a checkpoint."""


def write_checkpoint(save: Callable, filename: str) -> None:
    """``save(handle)`` writes the checkpoint into an open file; it lands under `filename` whole."""
    with atomic_output(filename) as temporary:
        with open(temporary, "wb") as handle:
            save(handle)


def copy_checkpoint(source: str, destination: str) -> None:
    with atomic_output(destination) as temporary:
        shutil.copyfile(source, temporary)


def remove_partial_checkpoints(save_dir: str) -> None:
    """Delete the temporary checkpoint files a run killed mid-save left in `save_dir` (called
    where fairseq-train starts or resumes a run there), logging each."""
    for path in remove_leftover_temporaries(save_dir, "checkpoint*.pt"):
        logger.info(f"removed {path}, a partial checkpoint of a run stopped while saving")


def read_checkpoint(path: str) -> dict:
    """The state stored in `path`, its tensors mapped from the file rather than read into memory.

    Raises UnreadableCheckpointError naming the file when it cannot be unpickled. Checkpoints
    pickle their configuration, so this loads code: use it on your own checkpoints only.
    """
    try:
        # torch's zip format can be mapped; a truncated file has no zip directory and is read
        # in full, which then fails like any other broken file.
        return torch.load(
            path, map_location="cpu", weights_only=False, mmap=zipfile.is_zipfile(path)
        )
    except Exception as error:  # truncated zip, bad pickle, EOF: the file is unusable either way
        raise UnreadableCheckpointError(
            f"{path} cannot be read ({type(error).__name__}: {error}); it is truncated or not "
            "a checkpoint"
        ) from None


def weights_fingerprint(path: str) -> str:
    """12 hex digits of SHA-256 over the model's weights in checkpoint `path` (names, dtypes,
    shapes and values, in name order): equal for two checkpoints of the same weights, whatever
    else they store (optimizer state, training time), and different for any other weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(read_checkpoint(path)["model"].items()):
        tensor = tensor.detach().cpu()
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}\n".encode())
        digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:12]


def training_position(state: dict):
    """(epoch, updates) at which a checkpoint was saved, for ordering the files of a run."""
    history = state.get("optimizer_history") or [{}]
    iterator = (state.get("extra_state") or {}).get("train_iterator") or {}
    return iterator.get("epoch", 0), history[-1].get("num_updates", 0)


def newest_intact_checkpoint(save_dir: str, suffix: str = "", skip=()) -> Optional[str]:
    """The readable ``checkpoint*.pt`` of `save_dir` saved last (by epoch and updates, then
    modification time), leaving out the paths in `skip`; None if there is none."""
    found = []
    pattern = os.path.join(glob.escape(save_dir), f"checkpoint*{suffix}.pt")
    for path in sorted(glob.glob(pattern)):
        if path in skip:
            continue
        try:
            position = training_position(read_checkpoint(path))
        except UnreadableCheckpointError as error:
            logger.warning(str(error))
            continue
        found.append((position, os.path.getmtime(path), path))
    return max(found)[2] if found else None


@dataclass(frozen=True)
class ResumeSource:
    """The checkpoint fairseq-train is about to load."""

    path: str
    # --finetune-from-model on the run's first launch: a new model initialised from the weights
    finetune: bool = False
    # the checkpoint_last.pt that could not be read, and why, when `path` replaces it
    unreadable: Optional[str] = None
    reason: Optional[str] = None


def resume_source(cfg, suffix: str = "") -> Optional[ResumeSource]:
    """What fairseq's ``checkpoint_utils.load_checkpoint`` reads under the checkpoint options
    `cfg`, with an unreadable ``checkpoint_last.pt`` replaced by the newest intact checkpoint;
    None when the run starts from scratch."""
    restore = cfg.restore_file
    if restore != DEFAULT_RESTORE_FILE:
        path = restore.replace(".pt", suffix + ".pt") if suffix else restore
        return _readable(path, "--restore-file") if os.path.isfile(path) else None
    last = os.path.join(cfg.save_dir, f"checkpoint_last{suffix}.pt")
    if os.path.exists(last):
        try:
            read_checkpoint(last)
            return ResumeSource(last)
        except UnreadableCheckpointError as error:
            return _fallback_for(last, cfg.save_dir, suffix, str(error))
    # fairseq writes a save's first file and copies it to checkpoint_last.pt afterwards: a run
    # killed in between has its checkpoints but no checkpoint_last.pt, and would start again
    # from scratch and overwrite them. (A run with --no-last-checkpoints never resumes: fairseq
    # starts it again, and so does this.)
    writes_last = not getattr(cfg, "no_last_checkpoints", False)
    earlier = (
        newest_intact_checkpoint(cfg.save_dir, suffix)
        if writes_last and os.path.isdir(cfg.save_dir)
        else None
    )
    if earlier is not None:
        reason = f"{last} does not exist (a run stopped while saving its first checkpoint?)"
        return ResumeSource(earlier, unreadable=last, reason=reason)
    continue_once = getattr(cfg, "continue_once", None)
    if continue_once:
        if not os.path.isfile(continue_once):
            return None
        return _readable(continue_once, "--continue-once")
    if cfg.finetune_from_model and os.path.isfile(cfg.finetune_from_model):
        return _readable(cfg.finetune_from_model, "--finetune-from-model", finetune=True)
    return None  # fairseq itself names a missing --finetune-from-model


def _readable(path: str, option: str, finetune: bool = False) -> ResumeSource:
    try:
        read_checkpoint(path)
    except UnreadableCheckpointError as error:
        raise UnreadableCheckpointError(f"{option}: {error}; give another checkpoint") from None
    return ResumeSource(path, finetune=finetune)


def _fallback_for(last: str, save_dir: str, suffix: str, reason: str) -> ResumeSource:
    fallback = newest_intact_checkpoint(save_dir, suffix, skip={last})
    if fallback is None:
        raise UnreadableCheckpointError(
            f"cannot resume: {reason}, and no other checkpoint in {save_dir} can be read. "
            "Start a new run in a new --save-dir, or give an intact checkpoint with --restore-file"
        )
    return ResumeSource(fallback, unreadable=last, reason=reason)


def with_restore_file(cfg, source: ResumeSource, suffix: str = ""):
    """A copy of the checkpoint options `cfg` that makes fairseq load `source` instead of an
    unreadable checkpoint_last.pt (fairseq adds `suffix` to --restore-file itself)."""
    path = source.path
    if suffix and path.endswith(suffix + ".pt"):
        path = path[: -len(suffix + ".pt")] + ".pt"
    cfg = copy.deepcopy(cfg)
    cfg.restore_file = path
    cfg.finetune_from_model = None  # fairseq refuses it beside a --restore-file
    return cfg


def log_fallback(source: ResumeSource) -> None:
    kept = (
        f" {source.unreadable} is left as it is until this run's next save replaces it: copy "
        "it elsewhere now if you want to inspect it."
        if os.path.exists(source.unreadable)
        else ""
    )
    logger.warning(
        f"{source.reason}. Resuming from {source.path} instead, the newest intact checkpoint "
        f"in its folder.{kept}"
    )


# The checkpoint options of the fairseq-train run in progress in this process (None outside).
_training_run = []


@contextlib.contextmanager
def fairseq_train_run(checkpoint_cfg):
    """Marks the body as fairseq-train's main with these checkpoint options."""
    _training_run.append(checkpoint_cfg)
    try:
        yield
    finally:
        _training_run.pop()


def current_fairseq_train_run():
    """The checkpoint options of the fairseq-train run building a model now, or None when the
    model is built by anything else (fairseq-generate, analysis tools, pruning)."""
    return _training_run[-1] if _training_run else None


def parameter_shape_mismatches(model: torch.nn.Module, stored_model: dict) -> list:
    """``"name: checkpoint (a, b), model (c, d)"`` for each parameter both hold in other shapes."""
    own = model.state_dict()
    return [
        f"{name}: checkpoint {tuple(stored_model[name].shape)}, model {tuple(own[name].shape)}"
        for name in sorted(own.keys() & stored_model.keys())
        if hasattr(stored_model[name], "shape") and stored_model[name].shape != own[name].shape
    ]
