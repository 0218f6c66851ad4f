"""Training runs keyed by their settings, trained to convergence, resumable; the study report.

A run's folder is named after its model and a hash of every fairseq-train option that shapes
its training (data, model, schedule, seed), so a changed setting makes a new run and an
unchanged one finds its folder again. The budget (``--max-update``, ``--patience``) is not part
of the key: a run stopped by a smaller cap continues from its ``checkpoint_last.pt`` when the cap
is raised, and a killed study continues every unfinished run where its last checkpoint left it.
A run is finished when validation loss has not improved for ``patience`` validations (one per
epoch) or when it reached the cap.

The key names data folders of the study relative to its work folder and the plugin by its package
name, so the same settings give the same key on another machine or in another folder. A scored
run leaves a small record (its BLEU, speed and validation curve, keyed the same way): a study
given a folder of records from earlier sessions, on this machine or another, reads the runs
recorded there under the same budget instead of training them again.
"""

import hashlib
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass

import torch

from ..file_safety import atomic_output, atomic_write_text
from .fairseq_runner import USER_DIR, RunFailed, TrainingJob, train_side_by_side
from .training_progress import RunLog, json_log_options

# Options that set the budget or where things go, not what is trained.
BUDGET_OPTIONS = {"--max-update": 1, "--max-epoch": 1, "--patience": 1, "--save-dir": 1}
LOG_INTERVAL = 50
BANDED = (
    "{encoder_self: {all: [local-2, local-2, local-4, local-4, local-8, local-8, local-16, "
    "local-16]}}"
)
# name -> (label, fairseq-train options beyond the shared sizes and schedule)
MODELS = {
    "baseline": ("transformer (baseline)", ["--arch", "transformer"]),
    "local_tied": (
        "transformer_local_tied (Pande et al. (i))",
        ["--arch", "transformer_local_tied"],
    ),
    "localness": ("transformer_localness (Yang et al.)", ["--arch", "transformer_localness"]),
    "dynwin": ("transformer_dynwin (Nguyen et al.)", ["--arch", "transformer_dynwin"]),
    "gates_l0": (
        "encoder head gates + L0, pruned (Voita et al.)",
        ["--arch", "transformer_local", "--head-gates", "enc",
         "--criterion", "label_smoothed_cross_entropy_l0", "--l0-lambda", "0.01"],
    ),  # fmt: skip
    "banded": (
        "banded local-K encoder, K = 2, 4, 8, 16 (Alastruey et al.'s form)",
        ["--arch", "transformer_local", "--locality-config", BANDED],
    ),
}


def localness_ablation(label, *options):
    """Yang et al.'s default localness model with one setting changed."""
    return f"localness, {label}", ["--arch", "transformer_localness", *options]


# Ablations, trained only when --models names them: what explains a model's result against the
# baseline. "plain" is the control of every plugin model (its attention module, no locality);
# the others vary one setting of Yang et al.'s localness or Nguyen et al.'s windows at a time.
ABLATIONS = {
    "plain": ("transformer_local, no locality (control)", ["--arch", "transformer_local"]),
    "localness_code": localness_ablation(
        "centre as in Yang et al.'s code", "--localness-centre", "code"
    ),
    "localness_head": localness_ablation("head-specific windows", "--localness-window", "head"),
    "localness_fixed": localness_ablation("fixed window D = 10", "--localness-window", "fixed"),
    "localness_layer1": localness_ablation(
        "encoder layer 1 only", "--localness-layers", "encoder_self:0"
    ),
    "baseline_lr1e-3": ("transformer, lr 1e-3", ["--arch", "transformer", "--lr", "1e-3"]),
    "localness_lr1e-3": localness_ablation("lr 1e-3", "--lr", "1e-3"),
    "dynwin_lr1e-3": (
        "transformer_dynwin, lr 1e-3", ["--arch", "transformer_dynwin", "--lr", "1e-3"]
    ),
    "dynwin_enc": (
        "dynamic windows in the encoder only (AW, layers 1-3)",
        ["--arch", "transformer_dynwin",
         "--dynamic-window", "decoder_cross:none decoder_self:none"],
    ),  # fmt: skip
}
RUNNABLE = {**MODELS, **ABLATIONS}  # name -> (label, options), what --models may name


def without_options(argv, options):
    """`argv` without the options named in {option: number of values}."""
    kept, tokens = [], iter(argv)
    for token in tokens:
        if token in options:
            for _ in range(options[token]):
                next(tokens, None)
        else:
            kept.append(token)
    return kept


def portable_option(token, work_dir):
    """A path that differs between machines named by what it is: a folder of the work dir
    relative to it (under the work dir's own name, the corpus), the plugin as its package."""
    token = str(token)
    if token == USER_DIR:
        return "local_attn_fairseq"
    if work_dir and os.path.isabs(token):
        inside = os.path.relpath(token, work_dir)
        if not inside.startswith(os.pardir):
            return os.path.join(os.path.basename(os.path.normpath(work_dir)), inside)
    return token


def run_key(argv, work_dir=None):
    """A short hash of the options that decide what a run trains (not its budget), the same
    wherever the work dir lies."""
    settings = [
        portable_option(a, work_dir) for a in without_options([str(a) for a in argv], BUDGET_OPTIONS)
    ]
    return hashlib.sha256("\0".join(settings).encode("utf-8")).hexdigest()[:12]


@dataclass
class TrainingRun:
    """One model and seed: ``argv`` holds every fairseq-train option but the budget."""

    name: str
    label: str
    argv: list
    work_dir: str

    @property
    def key(self):
        return run_key(self.argv, self.work_dir)

    def option(self, name):
        """The value of one fairseq option of the run (``--seed``, say)."""
        return self.argv[self.argv.index(name) + 1]

    @property
    def seed(self):
        return int(self.option("--seed"))

    @property
    def save_dir(self):
        return os.path.join(self.work_dir, "runs", f"{self.name}-{self.key}")

    @property
    def log_path(self):
        return os.path.join(self.save_dir, "train.log")

    def log(self, max_update=None):
        return RunLog(self.log_path, self.label, max_update=max_update)


def bad_validations(validations):
    """Validations since the best one (a tie is no improvement, as fairseq counts it)."""
    if not validations:
        return 0
    losses = [v.loss for v in validations]
    return len(losses) - 1 - losses.index(min(losses))


def is_finished(log, max_update, patience):
    """Whether a run's log shows it converged (patience exhausted) or reached the cap."""
    if log.num_updates >= max_update:
        return True
    return patience > 0 and bad_validations(log.validations) >= patience


def train_command(run, max_update, patience, log):
    return [
        sys.executable, "-m", "local_attn_fairseq.experiments.fairseq_train",
        "--bad-validations", str(bad_validations(log.validations)),
        "--wall-offset", str(log.validations[-1].wall or 0 if log.validations else 0), "--",
        *map(str, run.argv), "--save-dir", run.save_dir, "--max-update", str(max_update),
        "--patience", str(patience), *json_log_options(LOG_INTERVAL),
    ]  # fmt: skip


def training_job(run, max_update, patience):
    """The job that starts (or continues) one run's training; its log grows by one session."""
    os.makedirs(run.save_dir, exist_ok=True)
    settings = os.path.join(run.save_dir, "settings.json")
    if not os.path.exists(settings):
        atomic_write_text(settings, json.dumps({"name": run.name, "argv": run.argv}, indent=2))
    progress = run.log(max_update)
    progress.update()  # the sessions so far: where this one resumes
    command = train_command(run, max_update, patience, progress)
    progress.label = f"{run.label} [{os.path.basename(run.save_dir)}]"
    return TrainingJob(run.label, command, progress, append=True)


def finished_log(run, max_update):
    log = run.log(max_update)
    log.update()
    return log


def train_runs(runs, max_update, patience, jobs=1, display=None, poll=1.0, on_finished=None):
    """Train every unfinished run, `jobs` at a time with the cores split between them,
    showing one progress line per run in training; ``on_finished(run, log)`` is called for
    each run as soon as it is finished (before the others are, for those in training)."""
    unfinished = {}
    for run in runs:
        log = finished_log(run, max_update)
        if is_finished(log, max_update, patience):
            print(f"| {run.label}: finished in {run.save_dir}, reused", flush=True)
            if on_finished:
                on_finished(run, log)
        else:
            unfinished[run.save_dir] = (run, training_job(run, max_update, patience))

    def job_finished(job):
        run = next(r for r, j in unfinished.values() if j is job)
        if on_finished:
            on_finished(run, finished_log(run, max_update))

    jobs_to_train = [job for _, job in unfinished.values()]
    train_side_by_side(jobs_to_train, jobs, display, poll, on_finished=job_finished)


# ---- records of scored runs --------------------------------------------------------------


def record_path(records_dir, corpus, run):
    return os.path.join(records_dir, f"{corpus}-{run.name}-seed{run.seed}-{run.key}.json")


# What the report reads of every recorded run (``summarise``, the curves), its budget first: a
# record without one of them (written by hand, or by another version) is refused by name, not
# met later as a KeyError.
RECORD_FIELDS = (
    "max_update", "patience", "seed", "bleu", "updates_trained", "updates_to_convergence",
    "converged", "train_words_per_s", "encoder_attention_params", "validations",
)  # fmt: skip


def read_record(path, max_update, patience, fields=RECORD_FIELDS, pass_over_others=False):
    """The record at ``path``, or None when the run is not recorded under this budget;
    ``fields`` are those it must hold, the budget's two first.

    A record of the same run under another budget is refused (RunFailed): a run trained under
    this one would replace it, and in a folder the user names (records carried across sessions
    and machines, a committed study) a study under another cap keeps its records in a folder of
    its own. With ``pass_over_others`` it is passed over (None): in the work folder's own
    records (the results of its runs, which a higher cap continues), or where nothing will be
    written (a report)."""
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except ValueError as e:
        raise RunFailed(f"{path} is not a record of a study run ({e}): move it away") from None
    if not isinstance(record, dict):
        raise RunFailed(f"{path} is not a record of a study run (not a JSON object): move it away")
    missing = [field for field in fields[:2] if field not in record]
    if not missing and (record["max_update"], record["patience"]) != (max_update, patience):
        if pass_over_others:
            return None
        raise RunFailed(
            f"{path} records this run under another budget (max_update {record['max_update']}, "
            f"patience {record['patience']}; this study: {max_update}, {patience}); a study "
            "under another budget needs its own records folder (--records), so that neither "
            "replaces the other's records"
        )
    missing += [field for field in fields[2:] if field not in record]
    if missing:
        raise RunFailed(
            f"{path} is not a complete record of a study run: it lacks {', '.join(missing)}; "
            "move it away"
        )
    return record


def write_record(path, result, run, max_update, patience):
    """A scored run's result, kept without the paths of this machine; returns the record."""
    record = {k: v for k, v in result.items() if k != "save_dir"}
    record.update(
        name=run.name, key=run.key, max_update=max_update, patience=patience,
        machine=f"{os.cpu_count()} CPU cores",
    )  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write_text(path, json.dumps(record, indent=1))
    return record


def encoder_attention_parameters(checkpoint):
    """Encoder self-attention weights (no biases) in the checkpoint: each tensor is stored once."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["model"]
    return sum(
        v.numel()
        for k, v in state.items()
        if k.startswith("encoder.layers.") and ".self_attn." in k and k.endswith("weight")
    )


def convergence_update(log):
    """Updates at the best validation loss (the checkpoint that is scored)."""
    if not log.validations:
        return log.num_updates
    return min(log.validations, key=lambda v: v.loss).num_updates


def summarise(results):
    """Mean and spread over seeds (sample standard deviation; 0 for one seed)."""
    scores = [r["bleu"] for r in results]

    def mean(key):
        value = statistics.mean(r[key] for r in results)
        return round(value) if math.isfinite(value) else value
    summary = {
        "bleu_mean": round(statistics.mean(scores), 2),
        "bleu_std": round(statistics.stdev(scores), 2) if len(scores) > 1 else 0.0,
        "bleu_min": min(scores),
        "bleu_max": max(scores),
        "updates_to_convergence": mean("updates_to_convergence"),
        "updates_trained": mean("updates_trained"),
        "converged_runs": sum(r["converged"] for r in results),
        "train_words_per_s": mean("train_words_per_s"),
        "encoder_attention_params": results[0]["encoder_attention_params"],
    }
    if "encoder_heads_kept" in results[0]:
        summary["encoder_heads_kept"] = [r["encoder_heads_kept"] for r in results]
    return summary


def plot_curves(curves, title, path):
    """Validation loss against updates and against training wall time, one colour per model
    (every seed drawn, the model named once)."""
    # imported here: matplotlib is slow to import and only the report draws
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_updates, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for colour, (label, runs) in enumerate(curves.items()):
        for i, validations in enumerate(runs):
            if not validations:
                continue
            style = dict(color=f"C{colour}", label=label if i == 0 else None, linewidth=1.2)
            losses = [v.loss for v in validations]
            by_updates.plot([v.num_updates for v in validations], losses, **style)
            timed = [(v.wall / 60, v.loss) for v in validations if v.wall is not None]
            if timed:
                by_time.plot(*zip(*timed), **style)
    by_updates.set_xlabel("updates")
    by_time.set_xlabel("training wall time (minutes)")
    for axis in (by_updates, by_time):
        axis.set_ylabel("validation loss")
        axis.grid(alpha=0.3)
    by_updates.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    with atomic_output(path) as temporary:
        fig.savefig(temporary, format="png", dpi=110)
    plt.close(fig)
