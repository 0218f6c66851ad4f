#!/usr/bin/env python3
"""Reproduce a row of a paper's results table at full scale: prepare the data, train, average
the last checkpoints, evaluate as the paper did, and print the result beside the paper's.

    python scripts/recipes/run_recipe.py --list
    python scripts/recipes/run_recipe.py pande_wmt14_en_de --list-rows
    python scripts/recipes/run_recipe.py pande_wmt14_en_de --row "1LocHead 7TiedLoc All6 (i)" \\
        --stage all --work-dir runs/pande_en_de

Stages: prepare (download or --raw-dir, sentencepiece, fairseq-preprocess; once per work dir),
train (fairseq-train; resumes where it stopped), average, evaluate, all. Hyper-parameters are
data in configs/recipes/RECIPE.yaml; --override changes any of them, --profile tiny shrinks a
recipe to a CPU smoke run. --dry-run prints the commands without running anything.
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import recipe_config as rc  # noqa: E402
from recipe_config import RecipeError  # noqa: E402

from local_attn_fairseq.file_safety import atomic_write_text, claim_output_dir  # noqa: E402

USER_DIR = os.path.join(rc.ROOT, "local_attn_fairseq")
STAGES = ("prepare", "train", "average", "evaluate", "all")


class RecipeRun:
    """One recipe in one work directory: data shared by its rows, one directory per row."""

    def __init__(self, recipe, work_dir, raw_dir=None, gpus=None, seed=1, dry_run=False):
        self.recipe, self.kind = recipe, recipe["kind"]
        self.work = os.path.abspath(work_dir)
        self.raw_dir = os.path.abspath(raw_dir) if raw_dir else None
        self.gpus, self.seed, self.dry_run = gpus, seed, dry_run
        self.data = os.path.join(self.work, "data", rc.data_name(recipe))
        self.bin = os.path.join(self.data, "bin")

    # ---- paths -------------------------------------------------------------------------
    def row_dir(self, row_name):
        return os.path.join(
            self.work, "rows", self.recipe["name"], rc.slug(row_name), f"seed{self.seed}"
        )

    def averaged(self, row_name):
        return os.path.join(self.row_dir(row_name), "averaged.pt")

    def final_checkpoint(self, row):
        name = "pruned.pt" if row["prune"] else "averaged.pt"
        return os.path.join(self.row_dir(row["name"]), name)

    # ---- prepare -----------------------------------------------------------------------
    def prepare(self):
        if self.kind == "speech":
            from speech import prepare_speech

            return prepare_speech(self)
        from text_preparation import prepare_text

        return prepare_text(self)

    # ---- train -------------------------------------------------------------------------
    def train_argv(self, row):
        train = self.recipe["train"]
        args = dict(row["args"])
        max_tokens = args.pop("max-tokens", train["max_tokens_per_gpu"])
        freq = args.pop("update-freq", None) or rc.update_freq(
            train["tokens_per_batch"], max_tokens, self.gpu_count()
        )
        argv = [self.data_path(row), "--user-dir", USER_DIR, "--arch", row["arch"]]
        argv += rc.options_to_argv(args)
        argv += ["--max-tokens", max_tokens, "--update-freq", freq, "--seed", self.seed]
        argv += ["--distributed-world-size", self.gpu_count()]
        argv += ["--save-dir", os.path.join(self.row_dir(row["name"]), "checkpoints")]
        argv += self.initialisation(row)
        if self.kind == "speech":
            from speech import train_task_args

            argv += train_task_args(self, row)
        return argv

    def data_path(self, row):
        if self.kind == "speech":
            from speech import speech_data_dir

            return speech_data_dir(self, row)
        return self.bin

    def initialisation(self, row):
        """Options that start a row from another row's result (fine-tuning, ASR -> ST, a
        pruned shape trained from scratch)."""
        argv = []
        if row["base_row"]:
            flag = {"model": "--finetune-from-model", "encoder": "--load-pretrained-encoder-from"}
            if row["init"] not in flag:
                raise RecipeError(f"row {row['name']!r}: init must be model or encoder")
            argv += [flag[row["init"]], self.averaged(row["base_row"])]
        if row["heads_kept_from_row"]:
            path = os.path.join(self.row_dir(row["heads_kept_from_row"]), "heads_kept.json")
            kept = path if self.dry_run else self.read_heads_kept(path)
            argv += ["--heads-kept", kept]
        return argv

    @staticmethod
    def read_heads_kept(path):
        with open(path) as f:
            return json.dumps({t: [len(h) for h in layers] for t, layers in json.load(f).items()})

    def gpu_count(self):
        if self.gpus is None:
            import torch

            self.gpus = max(1, torch.cuda.device_count())
        return self.gpus

    def train(self, row):
        log = os.path.join(self.row_dir(row["name"]), "train.log")
        self.run_tool("fairseq-train", self.train_argv(row), log)

    def run_tool(self, tool, argv, log_path):
        import fairseq_runner

        if self.dry_run:
            print(fairseq_runner.command_line(tool, [str(a) for a in argv]))
            return None
        return fairseq_runner.run(tool, argv, log_path)

    # ---- average -----------------------------------------------------------------------
    def average(self, row):
        from average_checkpoints import average_checkpoints, last_checkpoints

        save_dir = os.path.join(self.row_dir(row["name"]), "checkpoints")
        last = int(row["average"].get("last", 1))
        if self.dry_run:
            print(f"$ python scripts/recipes/average_checkpoints.py {save_dir} "
                  f"{self.averaged(row['name'])} --last {last}")  # fmt: skip
        else:
            paths = last_checkpoints(save_dir, last)
            average_checkpoints(paths, self.averaged(row["name"]))
            print(f"| averaged {len(paths)} checkpoints -> {self.averaged(row['name'])}")
        if row["prune"]:
            self.prune(row)

    def prune(self, row):
        pruned = self.final_checkpoint(row)
        if self.dry_run:
            print(f"$ python scripts/prune_heads.py {self.averaged(row['name'])} {pruned}")
            return
        from local_attn_fairseq.modules.head_pruning import heads_table, prune_checkpoint

        before, kept, _ = prune_checkpoint(self.averaged(row["name"]), pruned)
        print(heads_table(before, kept))
        kept_path = os.path.join(self.row_dir(row["name"]), "heads_kept.json")
        atomic_write_text(kept_path, json.dumps(kept))

    # ---- evaluate ----------------------------------------------------------------------
    def evaluate(self, row):
        from evaluation import evaluate_row

        return evaluate_row(self, row)

    # ---- stages with what they need ----------------------------------------------------
    def run_stage(self, stage, row):
        if stage in ("prepare", "all"):
            self.prepare()
        if stage in ("train", "all"):
            self.ensure_dependencies(row)
            self.train(row)
        if stage in ("average", "all"):
            self.average(row)
        if stage in ("evaluate", "all"):
            return self.evaluate(row)
        return None

    def ensure_dependencies(self, row):
        """Train (and average, prune) the rows this row starts from, unless already done."""
        for dep_name, needed in (
            (row["base_row"], self.averaged),
            (
                row["heads_kept_from_row"],
                lambda n: os.path.join(self.row_dir(n), "heads_kept.json"),
            ),
        ):
            if dep_name and (self.dry_run or not os.path.exists(needed(dep_name))):
                dep = rc.get_row(self.recipe, dep_name)
                print(f"| row {row['name']!r} starts from row {dep_name!r}", flush=True)
                self.ensure_dependencies(dep)
                self.train(dep)
                self.average(dep)


def list_rows(recipe):
    print(f"{recipe['name']}: {recipe.get('paper', '')} ({recipe['kind']}, data {recipe['data']})")
    for name, row in recipe["rows"].items():
        paper = ", ".join(f"{k} {v}" for k, v in (row.get("paper") or {}).items())
        mark = "  [not runnable: see --row]" if row.get("unsupported") else ""
        print(f"  {name!r:48s} {row.get('table', ''):28s} paper: {paper}{mark}")


def claim_work_dir(work_dir, overwrite):
    try:
        claim_output_dir(work_dir, "run_recipe", overwrite)
    except FileExistsError as e:
        raise RecipeError(f"--work-dir {e}") from None


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
        "{train,valid,test}.{SRC,TGT} text files (for MuST-C: the MuST-C root)",
    )
    parser.add_argument("--gpus", type=int, help="GPUs to train on (default: all visible, or 1)")
    parser.add_argument("--seed", type=int, default=1, help="training seed (own run directory)")
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
        if not args.dry_run:
            import fairseq_runner

            claim_work_dir(args.work_dir, args.overwrite)
            fairseq_runner.configure_logging()
        run = RecipeRun(recipe, args.work_dir, args.raw_dir, args.gpus, args.seed, args.dry_run)
        run.run_stage(args.stage, row)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
