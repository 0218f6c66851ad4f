"""The speech recipes (Alastruey et al., MuST-C): data preparation is
``scripts/data/prepare_mustc.py`` (log-mel features, sentencepiece, fairseq's speech_to_text
manifests and configs); rows train on its ASR or ST task and score WER or BLEU.
"""

import os
import subprocess
import sys

import scoring
from recipe_config import ROOT, RecipeError

PREPARE_SCRIPT = os.path.join(ROOT, "scripts", "data", "prepare_mustc.py")


def task_files(run, row):
    """{config, train, valid, test} of the row's task (asr or st)."""
    tasks = run.recipe["data"]["tasks"]
    if row["data"] not in tasks:
        raise RecipeError(f"row {row['name']!r}: data must be one of {', '.join(tasks)}")
    return tasks[row["data"]]


def prepare_speech(run):
    data = run.recipe["data"]
    command = [sys.executable, PREPARE_SCRIPT, "--mustc-root", run.raw_dir or "MUSTC_ROOT"]
    settings = run.recipe.get("prepare", {})
    command += ["--lang", data["lang"], "--out-dir", run.data]
    command += ["--vocab-size", settings.get("vocab_size", 8000)]
    command += ["--vocab-type", settings.get("model_type", "unigram")]
    command = [str(c) for c in command]
    print("$ " + " ".join(command), flush=True)
    if run.dry_run:
        return
    if not run.raw_dir:
        raise RecipeError(f"MuST-C cannot be downloaded automatically: {data['manual']}")
    if not os.path.exists(PREPARE_SCRIPT):
        raise RecipeError(f"{PREPARE_SCRIPT} is missing: the speech data cannot be prepared")
    configs = [t["config"] for t in data["tasks"].values()]
    if all(os.path.exists(os.path.join(run.data, c)) for c in configs):
        return
    if subprocess.run(command).returncode != 0:
        raise RecipeError(f"{' '.join(command)} failed (its output is above)")


def speech_data_dir(run, row):
    return run.data


def train_task_args(run, row):
    files = task_files(run, row)
    return ["--config-yaml", files["config"], "--train-subset", files["train"],
            "--valid-subset", files["valid"]]  # fmt: skip


def evaluate_speech(run, row, checkpoint, subset):
    from evaluation import decode_argv

    files = task_files(run, row)
    settings = row["evaluate"]
    argv, output = decode_argv(run, row, checkpoint, files[subset], settings)
    argv += ["--task", "speech_to_text", "--config-yaml", files["config"]]
    argv += ["--scoring", "sacrebleu", "--num-workers", 0]
    log = os.path.join(run.row_dir(row["name"]), "generate.log")
    run.run_tool("fairseq-generate", argv, log)
    if run.dry_run:
        return {}
    hyps, refs = scoring.read_generate_output(output)
    if not hyps:
        raise RecipeError(f"{output}: no hypotheses")
    if settings.get("metric") == "wer":
        return {"wer": scoring.word_error_rate(hyps, refs)}
    return {"bleu": scoring.sacrebleu_score(hyps, refs)}
