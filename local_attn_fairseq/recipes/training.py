"""The train stage: a row's fairseq-train command (the paper's tokens per update on the GPUs at
hand, the row's start from another row's model) and its run, resumed where it stopped.
``run`` is the recipe's workspace (``workspace.RecipeWorkspace``).

A row's folder holds the checkpoints of one set of settings: ``settings.json`` records them when
training starts, and a later run of the row there with other settings is refused (it would
resume those checkpoints under the new settings and average checkpoints of both).
"""

import json
import os

from ..experiments.fairseq_runner import USER_DIR, command_line, last_session_finished
from ..file_safety import atomic_write_text
from .config import RecipeError, batch_plan, differences, options_to_argv
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


def training_settings(run, row):
    """What the row's checkpoints depend on, as JSON values. Not the GPU count: the batch plan
    keeps the tokens per update on any count, so a run may resume on other GPUs."""
    train = run.recipe["train"]
    settings = {
        "data": os.path.basename(run.data),  # names the prepare settings (config.data_name)
        "arch": row["arch"],
        "args": row["args"],
        "tokens_per_batch": train["tokens_per_batch"],
        "base_row": row["base_row"],
        "init": row["init"] if row["base_row"] else None,
        "heads_kept_from_row": row["heads_kept_from_row"],
    }
    # YAML may give values JSON has no type for (dates): compared as the record stores them
    return json.loads(json.dumps(settings, default=str))


def check_settings(run, row, needed_by=None):
    """Refuse (RecipeError) to use the row's folder when its checkpoints were trained with
    other settings than the row has now. A folder without a record passes, and so does one
    without checkpoints (a run that failed before its first save: its record is replaced).
    ``needed_by``: the row that would start from this row's result (its base row is checked
    against what this invocation would train it with, before that result is reused)."""
    path = run.settings_record(row["name"])
    if not os.path.isfile(path) or not _has_checkpoints(run.row_dir(row["name"])):
        return
    try:
        with open(path, encoding="utf-8") as f:
            recorded = json.load(f)["settings"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise RecipeError(
            f"{path} cannot be read ({error}); it records the settings of the row's "
            "checkpoints: use another --work-dir"
        ) from None
    changed = differences(recorded, training_settings(run, row))
    if changed:
        which = f"row {row['name']!r}"
        if needed_by:
            which = f"row {needed_by!r} starts from row {row['name']!r}, which"
        raise RecipeError(
            f"{which} was trained in this --work-dir with other settings "
            f"({'; '.join(changed)}; recorded in {path}). Use another --work-dir for the "
            "new settings, or the recorded ones to resume or evaluate this run"
        )


def _has_checkpoints(row_dir):
    saved = os.path.join(row_dir, "checkpoints")
    names = os.listdir(saved) if os.path.isdir(saved) else []
    trained = any(n.startswith("checkpoint") and n.endswith(".pt") for n in names)
    return trained or os.path.exists(os.path.join(row_dir, "averaged.pt"))


def record_settings(run, row, argv):
    """Write the row's settings, the command line's changes and its fairseq-train command into
    its folder (whole or not at all: a killed write leaves the old record)."""
    record = {
        "settings": training_settings(run, row),
        "given": run.settings_given,
        "train_command": command_line("fairseq-train", argv)[2:],
    }
    atomic_write_text(run.settings_record(row["name"]), json.dumps(record, indent=2) + "\n")


def train(run, row):
    print(describe_batch(run, row), flush=True)
    log = os.path.join(run.row_dir(row["name"]), "train.log")
    argv = train_argv(run, row)
    if not run.dry_run:
        check_settings(run, row)
        if last_session_finished(log):  # fairseq would add an update to the finished model
            print(f"| {row['name']}: trained to its end before (see {log}); not trained again")
            return
        record_settings(run, row, argv)
    run.run_tool("fairseq-train", argv, log)
