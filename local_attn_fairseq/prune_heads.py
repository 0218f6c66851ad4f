"""``scripts/prune_heads.py``: remove the heads whose gates are closed from a checkpoint trained
with --head-gates (the pruning itself is ``modules.head_pruning.prune_checkpoint``).

What a user can get wrong is refused in one line, exit status 2, before anything is written: a
checkpoint that is missing, empty or truncated, and an output path that already holds a file
(the user's, which is replaced only with ``--overwrite``), is the input itself, is a folder or
lies under a regular file. A write that fails anyway (a full disk, no permission) is one line too.
"""

import argparse
import os
import sys

from .checkpoint_files import UnreadableCheckpointError, read_checkpoint
from .cli_types import output_file
from .file_safety import describe_os_error, refuse_same_file
from .modules.head_pruning import heads_table, prune_checkpoint

PROG = "prune_heads.py"


class PruneInputError(ValueError):
    """A checkpoint or output path that cannot be used: reported in one line."""


def build_parser(description=None):
    parser = argparse.ArgumentParser(prog=PROG, description=description)
    parser.add_argument("checkpoint", help="checkpoint of a model trained with --head-gates")
    parser.add_argument("output", help="where to write the pruned checkpoint")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing file at OUTPUT (by default it is refused, so that a mistyped "
        "output never destroys a file)",
    )
    return parser


def check_paths(checkpoint, output, overwrite=False):
    """Raise PruneInputError (ValueError for an output that is the input) unless `checkpoint`
    is a readable checkpoint and `output` may be written. Only a file the user asked to replace
    is ever replaced: the tool cannot tell its own earlier output from the user's file of the
    same name."""
    if not os.path.exists(checkpoint):
        raise PruneInputError(f"{checkpoint}: no such checkpoint file")
    if not os.path.isfile(checkpoint):
        raise PruneInputError(f"{checkpoint}: not a file")
    refuse_same_file(checkpoint, output)  # before reading it: the first mistake to name
    if os.path.getsize(checkpoint) == 0:
        raise PruneInputError(f"{checkpoint}: the file is empty, not a checkpoint")
    try:
        output_file(output)  # a folder, or a path under a regular file
    except argparse.ArgumentTypeError as error:
        raise PruneInputError(str(error)) from None
    if os.path.exists(output) and os.path.realpath(output) != os.path.realpath(checkpoint):
        if not overwrite:
            raise PruneInputError(
                f"{output} exists; choose a new output path, or pass --overwrite to replace it"
            )
    try:
        state = read_checkpoint(checkpoint)
    except UnreadableCheckpointError as error:
        raise PruneInputError(str(error)) from None
    if not isinstance(state, dict) or "model" not in state:
        raise PruneInputError(f"{checkpoint}: not a fairseq checkpoint (it has no model weights)")


def main(argv=None, description=None):
    args = build_parser(description).parse_args(argv)
    try:
        check_paths(args.checkpoint, args.output, args.overwrite)
        # ValueError: the output is the input, or the model has no head gates
        before, after, (params_before, params_after) = prune_checkpoint(
            args.checkpoint, args.output
        )
    except (PruneInputError, ValueError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # the output could not be written: the path is the user's to fix
        print(f"{PROG}: error: output: {describe_os_error(error)}", file=sys.stderr)
        return 2
    print(heads_table(before, after))
    print(f"model parameters: {params_before:,} -> {params_after:,} (written to {args.output})")
    return 0
