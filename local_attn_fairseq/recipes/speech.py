"""The data side of the speech recipes (Alastruey et al., MuST-C): preparation is
``local_attn_fairseq.data.mustc`` (log-mel features, sentencepiece, fairseq's speech_to_text
manifests and configs), run as its own process; rows train on its ASR or ST task. As for text,
``prepare.json`` beside the data records the MuST-C files and the settings it is made from, and
a prepare from other ones is refused.
``run`` is the recipe's workspace (``workspace.RecipeWorkspace``).
"""

import os
import subprocess
import sys

from .config import RecipeError, prepare_settings
from .workspace import raw_fingerprint

PREPARE_MODULE = "local_attn_fairseq.data.mustc"


def task_files(run, row):
    """{config, train, valid, test} of the row's task (asr or st)."""
    tasks = run.recipe["data"]["tasks"]
    if row["data"] not in tasks:
        raise RecipeError(f"row {row['name']!r}: data must be one of {', '.join(tasks)}")
    return tasks[row["data"]]


def prepare_command(run):
    """The preparation's command line: the recipe's vocabulary per task and SpecAugment policy
    (written into config_asr.yaml and config_st.yaml, which the train stage reads)."""
    data = run.recipe["data"]
    settings = prepare_settings(run.recipe)
    command = [sys.executable, "-m", PREPARE_MODULE, "--mustc-root", run.raw_dir or "MUSTC_ROOT"]
    command += ["--lang", data["lang"], "--out-dir", run.data]
    command += ["--vocab-type", settings["model_type"]]
    command += ["--asr-vocab-size", settings["vocab_size"]["asr"]]
    command += ["--st-vocab-size", settings["vocab_size"]["st"]]
    command += ["--specaugment", settings["specaugment"]]
    return [str(c) for c in command]


def prepare_speech(run):
    data = run.recipe["data"]
    command = prepare_command(run)
    print("$ " + " ".join(command), flush=True)
    if run.dry_run:
        return
    if not run.raw_dir:
        raise RecipeError(f"MuST-C cannot be downloaded automatically: {data['manual']}")
    raw_files = raw_source(run)
    if not run.check_prepared_inputs(raw_files):
        run.record_prepared_inputs(raw_files)
    configs = [t["config"] for t in data["tasks"].values()]
    if all(os.path.exists(os.path.join(run.data, c)) for c in configs):
        return
    if subprocess.run(command).returncode != 0:
        raise RecipeError(f"{' '.join(command)} failed (its output is above)")


def raw_source(run):
    """{name: [size, time]} of the MuST-C files of the recipe's language pair (what the
    preparation reads: en-LANG/data/SPLIT/{wav,txt})."""
    return raw_fingerprint(run.raw_dir, [os.path.join(f"en-{run.recipe['data']['lang']}", "data")])


def train_task_args(run, row):
    files = task_files(run, row)
    return ["--config-yaml", files["config"], "--train-subset", files["train"],
            "--valid-subset", files["valid"]]  # fmt: skip
