"""Average the parameters of the last N checkpoints of a fairseq training run.

    python scripts/recipes/average_checkpoints.py checkpoints/ averaged.pt --last 5

fairseq's own ``scripts/average_checkpoints.py`` is not part of its installed package, so this
is the recipes' version: checkpoints saved with ``--save-interval-updates`` are ordered by update
number (else the per-epoch ones by epoch), the last N are averaged element-wise in float64,
and the result is written with the other fields (configuration, optimizer history) of the
newest one, so fairseq-generate and fairseq-eval-lm load it like any checkpoint. The output
must not be one of the averaged checkpoints; it is written to a temporary file renamed into place,
and an existing file there is replaced only with ``--overwrite``. A checkpoint that cannot be read
(truncated, empty) is named in one line.

The average stage of a recipe row (``average``) averages its last checkpoints and, for a row
with ``prune``, removes the heads whose gates closed (``modules.head_pruning``).
"""

import argparse
import json
import os
import re
import sys

import torch

from ..checkpoint_files import UnreadableCheckpointError, read_checkpoint
from ..cli_types import output_file, positive_int
from ..file_safety import atomic_output, atomic_write_text, exit_on_os_error, refuse_same_file
from ..modules.head_pruning import heads_table, prune_checkpoint
from .config import RecipeError

_BY_UPDATE = re.compile(r"^checkpoint_\d+_(\d+)\.pt$")
_BY_EPOCH = re.compile(r"^checkpoint(\d+)\.pt$")


def last_checkpoints(save_dir, n):
    """Paths of the last ``n`` interval (else epoch) checkpoints in ``save_dir``, oldest first;
    ``checkpoint_last.pt`` alone when there are none (a run shorter than one interval)."""
    if n < 1:
        raise ValueError(f"cannot average the last {n} checkpoints")
    names = os.listdir(save_dir) if os.path.isdir(save_dir) else []
    for pattern in (_BY_UPDATE, _BY_EPOCH):
        numbered = sorted((int(m.group(1)), f) for f in names if (m := pattern.match(f)))
        if numbered:
            return [os.path.join(save_dir, f) for _, f in numbered[-n:]]
    if "checkpoint_last.pt" in names:
        return [os.path.join(save_dir, "checkpoint_last.pt")]
    raise FileNotFoundError(f"no checkpoint in {save_dir}: run the train stage first")


def average_checkpoints(paths, output):
    """Write the element-wise mean of the ``model`` weights of ``paths`` to ``output``."""
    for path in paths:
        refuse_same_file(path, output)
    total, newest = None, None
    for path in paths:
        state = read_checkpoint(path)  # UnreadableCheckpointError names a truncated file
        weights = state["model"]
        if total is None:
            total = {k: v.double() if v.is_floating_point() else v for k, v in weights.items()}
        else:
            if set(weights) != set(total):
                diff = sorted(set(weights) ^ set(total))[:5]
                raise ValueError(f"{path} has other parameters than {paths[0]}: {diff}")
            for k, v in weights.items():
                if v.is_floating_point():
                    total[k] += v.double()
        newest = state
    newest["model"] = _keep_sharing(
        newest["model"],
        {
            k: (v / len(paths)).to(newest["model"][k].dtype) if v.is_floating_point() else v
            for k, v in total.items()
        },
    )
    with atomic_output(output) as temporary:
        torch.save(newest, temporary)
    return output


def _keep_sharing(original, averaged):
    """Names that shared one tensor in the checkpoint (tied embeddings) share one again."""
    first_name = {}
    for key, value in original.items():
        first_name.setdefault(_tensor_identity(value), key)
    return {key: averaged[first_name[_tensor_identity(value)]] for key, value in original.items()}


def _tensor_identity(tensor):
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))


def average(run, row):
    """The average stage of ``row`` in the workspace ``run`` (``workspace.RecipeWorkspace``)."""
    save_dir = os.path.join(run.row_dir(row["name"]), "checkpoints")
    averaged = run.averaged(row["name"])
    last = row["average"].get("last", 1)  # checked by config.get_row
    if run.dry_run:
        print(f"$ python scripts/recipes/average_checkpoints.py {save_dir} {averaged} "
              f"--last {last}")  # fmt: skip
    else:
        try:
            paths = last_checkpoints(save_dir, last)
        except FileNotFoundError as error:
            raise RecipeError(str(error)) from None  # the train stage has not run
        try:
            average_checkpoints(paths, averaged)
        except UnreadableCheckpointError as error:
            raise RecipeError(
                f"{error}. Move it out of {save_dir} and run the average stage again (it then "
                "averages the checkpoints before it), or train the row again in a new --work-dir"
            ) from None
        print(f"| averaged {len(paths)} checkpoints -> {averaged}")
    if row["prune"]:
        prune(run, row)


def prune(run, row):
    """The row's averaged model without its closed heads, and the heads it kept."""
    averaged, pruned = run.averaged(row["name"]), run.final_checkpoint(row)
    if run.dry_run:
        print(f"$ python scripts/prune_heads.py {averaged} {pruned}")
        return
    before, kept, _ = prune_checkpoint(averaged, pruned)
    print(heads_table(before, kept))
    atomic_write_text(run.heads_kept(row["name"]), json.dumps(kept))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("save_dir", help="directory of a fairseq-train run (--save-dir)")
    parser.add_argument(
        "output", type=output_file, help="where to write the averaged checkpoint"
    )
    parser.add_argument(
        "--last", type=positive_int, default=5, help="how many checkpoints (default 5)"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing file at OUTPUT (by default it is refused, so that a mistyped "
        "output never destroys a file)",
    )
    args = parser.parse_args(argv)
    with exit_on_os_error("save_dir"):  # an unreadable folder
        try:
            paths = last_checkpoints(args.save_dir, args.last)
        except FileNotFoundError as e:  # no checkpoint in it
            sys.exit(f"error: {e}")
    try:
        for path in paths:
            refuse_same_file(path, args.output)  # with or without --overwrite
    except ValueError as e:
        sys.exit(f"error: {e}")
    # The tool cannot tell its own earlier output from a user's file of the same name.
    if os.path.exists(args.output) and not args.overwrite:
        sys.exit(
            f"error: {args.output} exists; choose a new output path, or pass --overwrite to "
            "replace it"
        )
    try:
        with exit_on_os_error("output"):
            average_checkpoints(paths, args.output)
    except (UnreadableCheckpointError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(f"| averaged {len(paths)} checkpoints ({', '.join(map(os.path.basename, paths))})")
