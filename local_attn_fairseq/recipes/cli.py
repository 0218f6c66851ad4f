"""Reproduce a row of a paper's results table at full scale: prepare the data, train, average
the last checkpoints, evaluate as the paper did, and print the result beside the paper's.

    local-attn-recipe --list
    local-attn-recipe pande_wmt14_en_de --list-rows
    local-attn-recipe pande_wmt14_en_de --row "1LocHead 7TiedLoc All6 (i)" \\
        --stage all --work-dir runs/pande_en_de

(``python scripts/recipes/run_recipe.py`` takes the same arguments.)

Stages: prepare (download or --raw-dir, sentencepiece, fairseq-preprocess; once per work dir),
train (fairseq-train; resumes where it stopped), average, evaluate, all. Hyper-parameters are
data in configs/recipes/RECIPE.yaml; --override changes any of them, --profile tiny shrinks a
recipe to a CPU smoke run. --dry-run prints the commands without running anything.
"""

import argparse
import sys

from ..cli_types import non_negative_int
from ..experiments.training_progress import console_logging
from ..file_safety import FolderNotOwned, claim_output_dir, describe_os_error
from . import config as rc
from .config import RecipeError
from .driver import RecipeRun
from .workspace import WORK_DIR_OWNER

STAGES = ("prepare", "train", "average", "evaluate", "all")


def list_rows(recipe):
    print(f"{recipe['name']}: {recipe.get('paper', '')} ({recipe['kind']}, data {recipe['data']})")
    for name, row in recipe["rows"].items():
        paper = ", ".join(f"{k} {v}" for k, v in (row.get("paper") or {}).items())
        mark = "  [not runnable: see --row]" if row.get("unsupported") else ""
        print(f"  {name!r:48s} {row.get('table', ''):28s} paper: {paper}{mark}")
    lines = rc.settings_not_from_paper(recipe.get("chosen"), recipe.get("departures"))
    if lines:
        print("\n".join(["", *lines, "| (a row may add its own: see the row's --dry-run)"]))


def claim_work_dir(work_dir, overwrite):
    try:
        claim_output_dir(work_dir, WORK_DIR_OWNER, overwrite)
    except FolderNotOwned as e:
        raise RecipeError(f"--work-dir {e}") from None
    except OSError as e:  # a path under a regular file, a folder without write permission
        raise RecipeError(
            f"--work-dir: {describe_os_error(e)}; choose a folder that can be created and written"
        ) from None


def build_parser():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("recipe", nargs="?", help="a recipe (see --list)")
    parser.add_argument("--list", action="store_true", help="list the recipes")
    parser.add_argument("--list-rows", action="store_true", help="list the recipe's rows")
    parser.add_argument("--row", help="the row of the paper's table to reproduce (see --list-rows)")
    parser.add_argument("--stage", choices=STAGES, default="all")
    parser.add_argument(
        "--work-dir",
        help="where data and runs go; recipes sharing a work dir share data prepared alike",
    )
    parser.add_argument(
        "--raw-dir",
        help="local raw files: the recipe's downloads under their official file names, or "
        "{train,valid,test}.{SRC,TGT} text files (for MuST-C: the MuST-C root); the prepared "
        "data records the files it was made from, and refuses to be prepared from others",
    )
    parser.add_argument("--gpus", type=int, help="GPUs to train on (default: all visible, or 1)")
    parser.add_argument(
        "--seed", type=non_negative_int, default=1, help="training seed (own run directory)"
    )
    parser.add_argument("--profile", help="settings profile from configs/recipes/profiles.yaml")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change a setting: a fairseq-train option (max-update=1000, dropout=0.3; null "
        "removes it) or a dotted recipe key (prepare.vocab_size=8000, average.last=10)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="use a non-empty --work-dir that the recipes did not create (nothing in it is "
        "deleted; files of the same names as the recipe's outputs are replaced)",
    )
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.list or not args.recipe:
        print("\n".join(rc.recipe_names()))
        return 0
    try:
        recipe = rc.with_settings(rc.load_recipe(args.recipe), args.profile, args.override)
        if args.list_rows:
            list_rows(recipe)
            return 0
        if not args.row:
            raise RecipeError("--row is required (see --list-rows)")
        row = rc.get_row(recipe, args.row)
        if not args.work_dir:
            raise RecipeError("--work-dir is required")
        # the workspace checks the prepare settings: a mistake there is named before the work
        # dir is claimed
        run = RecipeRun(
            recipe, args.work_dir, args.raw_dir, args.gpus, args.seed, args.dry_run,
            settings_given={"profile": args.profile, "overrides": args.override},
        )  # fmt: skip
        if not args.dry_run:
            claim_work_dir(args.work_dir, args.overwrite)
            console_logging()
        run.run_stage(args.stage, row)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
