"""Training runs keyed by their settings, trained to convergence, resumable; the study report.

A run's folder is named after its model and a hash of every fairseq-train option that shapes
its training (data, model, schedule, seed), so a changed setting makes a new run and an
unchanged one finds its folder again. The budget (``--max-update``, ``--patience``) is not part
of the key: a run stopped by a smaller cap continues from its ``checkpoint_last.pt`` when the cap
is raised, and a killed study continues every unfinished run where its last checkpoint left it.
A run is finished when validation loss has not improved for ``patience`` validations (one per
epoch) or when it reached the cap.
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
from .fairseq_runner import TrainingJob, train_side_by_side
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


def run_key(argv):
    """A short hash of the options that decide what a run trains (not its budget)."""
    settings = [str(a) for a in without_options([str(a) for a in argv], BUDGET_OPTIONS)]
    return hashlib.sha256("\0".join(settings).encode("utf-8")).hexdigest()[:12]


@dataclass
class TrainingRun:
    """One model and seed: ``argv`` holds every fairseq-train option but the budget."""

    name: str
    label: str
    argv: list
    work_dir: str

    @property
    def save_dir(self):
        return os.path.join(self.work_dir, "runs", f"{self.name}-{run_key(self.argv)}")

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


def train_runs(runs, max_update, patience, jobs=1, display=None, poll=1.0):
    """Train every unfinished run, `jobs` at a time with the cores split between them,
    showing one progress line per run in training. Returns {save_dir: RunLog}."""
    unfinished = []
    for run in runs:
        log = run.log(max_update)
        log.update()
        if is_finished(log, max_update, patience):
            print(f"| {run.label}: finished in {run.save_dir}, reused", flush=True)
        else:
            unfinished.append(training_job(run, max_update, patience))
    train_side_by_side(unfinished, parallel=jobs, display=display, poll=poll)
    logs = {}
    for run in runs:
        logs[run.save_dir] = run.log(max_update)
        logs[run.save_dir].update()
    return logs


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
