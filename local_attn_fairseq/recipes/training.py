"""The train stage: a row's fairseq-train command (the paper's tokens per update on the GPUs at
hand, the row's start from another row's model) and its run, resumed where it stopped.
``run`` is the recipe's workspace (``workspace.RecipeWorkspace``).
"""

import json
import os

from ..experiments.fairseq_runner import USER_DIR
from .config import RecipeError, batch_plan, options_to_argv
from .speech import train_task_args


def batch_options(run, row):
    """(--max-tokens, --update-freq) of the row on the run's GPUs: the paper's tokens per update
    (``train.tokens_per_batch``) from batches of at most ``max_tokens_per_gpu`` tokens (or the
    row's ``max-tokens``). A row or an override that sets ``update-freq`` is taken as given."""
    train, args = run.recipe["train"], row["args"]
    max_tokens = args.get("max-tokens", train["max_tokens_per_gpu"])
    if args.get("update-freq"):
        return max_tokens, args["update-freq"]
    return batch_plan(train["tokens_per_batch"], max_tokens, run.gpu_count())


def describe_batch(run, row):
    max_tokens, freq = batch_options(run, row)
    gpus = run.gpu_count()
    paper = run.recipe["train"]["tokens_per_batch"]
    return (
        f"| batch: {gpus} GPU{'s' if gpus > 1 else ''} x {max_tokens} tokens x update-freq {freq} "
        f"= {gpus * max_tokens * freq} tokens per update (train.tokens_per_batch {paper})"
    )


def train_argv(run, row):
    args = dict(row["args"])
    args.pop("max-tokens", None)
    args.pop("update-freq", None)
    max_tokens, freq = batch_options(run, row)
    argv = [run.data_path(row), "--user-dir", USER_DIR, "--arch", row["arch"]]
    argv += options_to_argv(args)
    argv += ["--max-tokens", max_tokens, "--update-freq", freq, "--seed", run.seed]
    argv += ["--distributed-world-size", run.gpu_count()]
    argv += ["--save-dir", os.path.join(run.row_dir(row["name"]), "checkpoints")]
    argv += initialisation(run, row)
    if run.kind == "speech":
        argv += train_task_args(run, row)
    return argv


def initialisation(run, row):
    """Options that start a row from another row's result (fine-tuning, ASR -> ST, a pruned
    shape trained from scratch)."""
    argv = []
    if row["base_row"]:
        flag = {"model": "--finetune-from-model", "encoder": "--load-pretrained-encoder-from"}
        if row["init"] not in flag:
            raise RecipeError(f"row {row['name']!r}: init must be model or encoder")
        argv += [flag[row["init"]], run.averaged(row["base_row"])]
    if row["heads_kept_from_row"]:
        path = run.heads_kept(row["heads_kept_from_row"])
        kept = path if run.dry_run else read_heads_kept(path)
        argv += ["--heads-kept", kept]
    return argv


def read_heads_kept(path):
    """--heads-kept's value: {attention type: [heads kept per layer]}, as JSON."""
    with open(path) as f:
        return json.dumps({t: [len(h) for h in layers] for t, layers in json.load(f).items()})


def train(run, row):
    print(describe_batch(run, row), flush=True)
    log = os.path.join(run.row_dir(row["name"]), "train.log")
    run.run_tool("fairseq-train", train_argv(run, row), log)
