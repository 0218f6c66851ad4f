"""The small-scale study on one corpus (train, prune, score every run) and its report.

The report is a Markdown section (one table and one learning-curve figure per corpus) written
to the study's work folder and, on request, between the markers of a tracked document such as
``docs/small_scale_study.md``, whose other text is kept.
"""

import json
import os
from dataclasses import dataclass

from ..file_safety import atomic_write_text
from ..modules.head_pruning import prune_checkpoint
from . import study
from .demo import bleu
from .fairseq_runner import up_to_date
from .training_progress import ProgressDisplay, Validation

REPORT_START = "<!-- small-scale study report: start -->"
REPORT_END = "<!-- small-scale study report: end -->"


@dataclass
class StudyCorpus:
    name: str  # ding-de-en, bible-en-es
    description: str
    bin_dir: str
    train_pairs: int
    test_sentences: int


def study_runs(corpus, work, base_argv, models, seeds):
    """{model: [TrainingRun per seed]}: the base options, the model's, the seed."""
    return {
        name: [
            study.TrainingRun(
                name,
                study.RUNNABLE[name][0],
                [corpus.bin_dir, *base_argv, *study.RUNNABLE[name][1], "--seed", str(seed)],
                work,
            )
            for seed in seeds
        ]
        for name in models
    }


def pruned_checkpoint(checkpoint, pruned=None):
    """The gated checkpoint with its closed heads pruned (into ``pruned``, by default beside it),
    and the number of encoder heads kept; reused while newer than the checkpoint."""
    pruned = pruned or checkpoint.replace(".pt", "_pruned.pt")
    record = pruned.replace(".pt", ".json")
    if not up_to_date(record, checkpoint):
        _, kept, _ = prune_checkpoint(checkpoint, pruned)
        heads = sum(len(layer) for layer in kept["encoder_self"])
        atomic_write_text(record, json.dumps({"encoder_heads_kept": heads}))
        print(f"| pruned {checkpoint}: {heads} encoder heads kept -> {pruned}", flush=True)
    with open(record, encoding="utf-8") as f:
        return pruned, json.load(f)["encoder_heads_kept"]


def score_run(run, log, corpus, max_update):
    """One finished run: its best checkpoint (pruned for the gated model) scored on test."""
    checkpoint = os.path.join(run.save_dir, "checkpoint_best.pt")
    rates = log.epoch_words_per_s[1:] or log.epoch_words_per_s  # the first epoch warms up
    result = {
        "seed": run.seed,
        "save_dir": run.save_dir,
        "updates_trained": log.num_updates,
        "updates_to_convergence": study.convergence_update(log),
        "converged": log.num_updates < max_update,
        "train_words_per_s": sum(rates) / len(rates) if rates else float("nan"),
        "validations": [vars(v) for v in log.validations],
    }
    if "--head-gates" in run.argv:
        checkpoint, result["encoder_heads_kept"] = pruned_checkpoint(checkpoint)
    result["encoder_attention_params"] = study.encoder_attention_parameters(checkpoint)
    generated = os.path.join(run.save_dir, "test", "generate-test.txt")
    result["bleu"] = bleu(corpus.bin_dir, checkpoint, generated)
    return result


def run_corpus(
    corpus, work, base_argv, models, seeds, max_update, patience, jobs, records=None,
    display=None, train=True, own_records=None,
):  # fmt: skip
    """Train (or continue, or reuse) and score every run of one corpus; a JSON-able summary.

    Each run is scored as soon as it is finished and its result recorded in ``records`` (a
    folder, by default ``work/records``); a run recorded there under the same budget is read,
    not trained. One recorded under another budget is trained under this one (its record then
    replaced) in the work folder's own records (``own_records``: by default, when ``records``
    is not given), and refused in any other folder (``study.read_record``) unless nothing is
    trained. With ``train=False`` only the recorded runs are summarised (a study in
    progress): models without any are left out, and ``missing_runs`` counts the others."""
    # the work folder's own records (the default): a higher cap's record replaces a run's
    own_records = records is None if own_records is None else own_records
    records = records or os.path.join(work, "records")
    runs = study_runs(corpus, work, base_argv, models, seeds)
    # seed by seed: a study stopped part-way has every model's first seeds
    everything = [runs[name][i] for i in range(len(seeds)) for name in runs]
    results, to_train = {}, []
    for run in everything:
        path = study.record_path(records, corpus.name, run)
        record = study.read_record(
            path, max_update, patience, pass_over_others=own_records or not train
        )
        if record is None:
            to_train.append(run)
        else:
            results[run.save_dir] = record
            print(f"| {run.label}, seed {run.seed}: recorded in {path}, reused", flush=True)
    print(
        f"| {corpus.description}: {len(everything)} runs, {len(results)} recorded, "
        f"{len(to_train)} to train or score in {work}/runs",
        flush=True,
    )

    def score_and_record(run, log):
        result = score_run(run, log, corpus, max_update)
        study.write_record(
            study.record_path(records, corpus.name, run), result, run, max_update, patience
        )
        results[run.save_dir] = result

    if train:
        study.train_runs(
            to_train, max_update, patience, jobs, display or ProgressDisplay(),
            on_finished=score_and_record,
        )  # fmt: skip
    summary = {}
    for name, model_runs in runs.items():
        model_results = [results[run.save_dir] for run in model_runs if run.save_dir in results]
        if not model_results:
            continue
        summary[name] = dict(
            study.summarise(model_results), label=study.RUNNABLE[name][0], runs=model_results
        )
    return {
        "corpus": corpus.name,
        "description": corpus.description,
        "train_pairs": corpus.train_pairs,
        "test_sentences": corpus.test_sentences,
        "models": summary,
        "recorded_runs": len(everything) - len(to_train),
        "missing_runs": len(everything) - len(results),
    }


def recorded_result(corpus, work, base_argv, models, records, max_update, patience):
    """What `records` holds of `models` on this corpus under this budget, every seed recorded
    there (e.g. the fixed-budget study beside a study to convergence); nothing is trained."""
    seeds = set()
    for name in models:
        prefix = f"{corpus.name}-{name}-seed"
        for file in os.listdir(records) if os.path.isdir(records) else []:
            seed = file[len(prefix) :].split("-", 1)[0]
            if file.startswith(prefix) and seed.isdigit():
                seeds.add(int(seed))
    result = run_corpus(
        corpus, work, base_argv, models, sorted(seeds), max_update, patience, 1, records,
        train=False,
    )  # fmt: skip
    return dict(result, max_update=max_update)


# Each paper's qualitative claim, as the study can test it against the baseline:
# (model, paper, claim, kind). "better": the model's BLEU is above the baseline's by more than
# the seeds' spread; "no worse": it is at most NO_WORSE_MARGIN below; "pruned": no worse, with
# at most a quarter of the encoder heads kept after pruning.
CLAIMS = [
    ("local_tied", "Pande et al.", "fixed local heads with tied Q/K lose little BLEU or gain",
     "no worse"),
    ("localness", "Yang et al. 2018", "Gaussian localness improves on the baseline", "better"),
    ("dynwin", "Nguyen et al. 2020", "dynamic windows improve on the baseline", "better"),
    ("gates_l0", "Voita et al. 2019", "3/4 of the encoder heads can be pruned for a small loss",
     "pruned"),
    ("banded", "Alastruey et al. 2022", "local windows in the encoder cost little BLEU",
     "no worse"),
]  # fmt: skip
NO_WORSE_MARGIN = 1.0  # BLEU
ENCODER_HEADS = 48  # the demo's 6 layers x 8 heads


def seeds_spread(model, baseline):
    """The seeds' spread of a model's BLEU against the baseline's; None where both have one
    seed, which gives none."""
    if max(len(model["runs"]), len(baseline["runs"])) < 2:
        return None
    return (model["bleu_std"] ** 2 + baseline["bleu_std"] ** 2) ** 0.5


def claim_verdict(kind, model, baseline, borrowed_spread=None):
    """(what was measured, verdict) of one claim, from two models' summaries.

    A "better" claim needs the model above the baseline by more than the seeds' spread. Runs of
    one seed have none: ``borrowed_spread`` (spread, where it was measured) stands in for it,
    the same models' spread under another budget, so that one seed's small lead is not taken
    for an improvement."""
    diff = model["bleu_mean"] - baseline["bleu_mean"]
    spread, spread_of = seeds_spread(model, baseline), "the seeds' spread"
    if spread is None and borrowed_spread is not None:
        spread, where = borrowed_spread
        spread_of = f"the seeds' spread {where}, {spread:.2f}"
    measured = (
        f"{model['bleu_mean']:.2f} ± {model['bleu_std']:.2f} vs {baseline['bleu_mean']:.2f} ± "
        f"{baseline['bleu_std']:.2f} ({diff:+.2f})"
    )
    if kind == "better":
        spread = spread or 0.0
        if diff > spread:
            return measured, "holds"
        if diff < -spread:
            return measured, "does not hold"
        return measured, f"not shown (within {spread_of})"
    verdict = "holds" if diff >= -NO_WORSE_MARGIN else "does not hold"
    if kind == "pruned":
        kept = model["encoder_heads_kept"]
        mean_kept = sum(kept) / len(kept)
        measured += f", {heads_kept(kept)} encoder heads kept"
        if mean_kept > ENCODER_HEADS / 4:
            verdict = "does not hold"
    return measured, verdict


def heads_kept(kept):
    """"8 of 48", "8-10 of 48": the encoder heads the seeds' pruned models kept."""
    heads = f"{min(kept)}" if min(kept) == max(kept) else f"{min(kept)}-{max(kept)}"
    return f"{heads} of {ENCODER_HEADS}"


def counted(number, noun):
    """"1 seed", "3 seeds": a count with its noun in the right number."""
    return f"{number} {noun}" + ("" if number == 1 else "s")


RATE_SUFFIX = "_lr"  # a model trained at another learning rate: <model>_lr<rate>
DEFAULT_RATE = "3e-3"  # the demo's schedule


def best_validation_loss(summary):
    """Mean over seeds of each run's best validation loss: what chooses a model's rate (its
    test BLEU never does)."""
    return sum(min(v["loss"] for v in r["validations"]) for r in summary["runs"]) / len(
        summary["runs"]
    )


def at_better_rate(models):
    """{model: (summary, rate)} for every model trained at more than one learning rate (the
    ``<model>_lr<rate>`` ablations beside it), each at the rate of its lower validation loss."""
    chosen = {}
    for name, summary in models.items():
        if RATE_SUFFIX in name:
            continue
        rates = {DEFAULT_RATE: summary}
        for other, other_summary in models.items():
            if other.startswith(name + RATE_SUFFIX):
                rates[other[len(name + RATE_SUFFIX) :]] = other_summary
        if len(rates) > 1:
            chosen[name] = min(rates.items(), key=lambda item: best_validation_loss(item[1]))[::-1]
    return chosen


def rate_lines(models):
    """The models trained at two rates: each rate's validation loss and BLEU, the better one."""
    chosen = at_better_rate(models)
    if not chosen:
        return []
    lines = [
        "Models trained at more than one learning rate (seeds of each rate as recorded); the "
        "better rate is the one of the lower best validation loss, never of the higher BLEU:",
        "",
        "| model | rate | best validation loss | BLEU (mean ± std) | updates to convergence |",
        "|---|---|---:|---:|---:|",
    ]
    for name, (_, rate) in chosen.items():
        for other in [name] + [m for m in models if m.startswith(name + RATE_SUFFIX)]:
            summary = models[other]
            this_rate = other[len(name + RATE_SUFFIX) :] if other != name else DEFAULT_RATE
            mark = " (better)" if this_rate == rate else ""
            lines.append(
                f"| {models[name]['label']} | {this_rate}{mark} | "
                f"{best_validation_loss(summary):.3f} | {summary['bleu_mean']:.2f} ± "
                f"{summary['bleu_std']:.2f} | {summary['updates_to_convergence']:,} |"
            )
    return lines + [""]


def claims_lines(result, compared=None):
    """The claims table of one corpus: every claim whose model and the baseline were run; with
    ``compared`` (the same corpus under another budget, e.g. the fixed-budget study) its
    verdicts beside, and for models trained at two rates, the verdict at the better rates."""
    models = result["models"]
    claimed = [c for c in CLAIMS if c[0] in models]
    if "baseline" not in models or not claimed:
        return []
    # a study in progress may have more seeds of some models than of others
    seeds = sorted({len(models[name]["runs"]) for name in ["baseline"] + [c[0] for c in claimed]})
    over = counted(seeds[0], "seed") if len(seeds) == 1 else f"{seeds[0]}-{seeds[-1]} seeds"
    better = at_better_rate(models)
    columns = ["measured", "verdict"]
    if better:
        columns.append("at each model's better rate")
    if compared:
        columns.append(f"at a cap of {compared['max_update']:,} updates")
    lines = [
        f"The papers' claims against this corpus's runs (BLEU mean ± std over {over}, "
        f"model vs baseline; \"little\" is at most {NO_WORSE_MARGIN:.0f} BLEU"
        + ("; one seed gives no spread, so a verdict is provisional" if seeds[0] < 2 else "")
        + ("; an improvement must exceed the same models' seeds' spread at the cap"
           if seeds[0] < 2 and compared else "")
        + "):",
        "",
        "| paper | claim | " + " | ".join(columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    baseline_better = better.get("baseline", (models["baseline"], DEFAULT_RATE))
    other = compared["models"] if compared else {}
    for name, paper, claim, kind in claimed:
        borrowed = None
        if name in other and "baseline" in other:
            spread = seeds_spread(other[name], other["baseline"])
            where = f"at a cap of {compared['max_update']:,} updates"
            borrowed = (spread, where) if spread is not None else None
        measured, verdict = claim_verdict(kind, models[name], models["baseline"], borrowed)
        cells = [measured, verdict]
        if better:
            model, rate = better.get(name, (models[name], DEFAULT_RATE))
            at_rate, rate_verdict = claim_verdict(kind, model, baseline_better[0], borrowed)
            cells.append(f"{rate_verdict}: lr {rate} vs {baseline_better[1]}, {at_rate}")
        if compared:
            if name in other and "baseline" in other:
                was, was_verdict = claim_verdict(kind, other[name], other["baseline"])
                cells.append(f"{was_verdict}: {was}")
            else:
                cells.append("not run")
        lines.append(f"| {paper} | {claim} | " + " | ".join(cells) + " |")
    return lines + [""]


def corpus_section(result, settings, image):
    """The Markdown of one corpus: the table and its learning curves."""
    seeds = ", ".join(map(str, settings["seeds"]))
    lines = [
        f"### {result['description']}",
        "",
        f"{result['train_pairs']:,} training pairs, BLEU on the {result['test_sentences']:,} test "
        f"sentences (best checkpoint by validation loss), seeds {seeds}; each run stopped when "
        f"validation loss had not improved for {settings['patience']} validations (one per "
        f"epoch) or at {result['max_update']:,} updates.",
        "",
    ]
    if not result["models"]:
        return lines + [
            f"No run of this corpus is recorded yet ({result.get('missing_runs', 0)} to train).",
            "",
        ]
    lines += [
        "| model | BLEU (mean ± std) | BLEU min-max | updates to convergence | updates trained "
        "(runs converged) | train words/s | encoder attention params |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in result["models"].values():
        label = s["label"]
        if "encoder_heads_kept" in s:
            label += f" ({heads_kept(s['encoder_heads_kept'])} encoder heads kept)"
        runs = len(s["runs"])
        lines.append(
            f"| {label} | {s['bleu_mean']:.2f} ± {s['bleu_std']:.2f} | "
            f"{s['bleu_min']:.2f}-{s['bleu_max']:.2f} | {s['updates_to_convergence']:,} | "
            f"{s['updates_trained']:,} ({s['converged_runs']}/{runs}) | "
            f"{s['train_words_per_s']:,} | {s['encoder_attention_params'] / 1e6:.3f}M |"
        )
    if result.get("missing_runs"):
        done = sum(len(s["runs"]) for s in result["models"].values())
        lines += [
            "",
            f"**A study in progress:** {done} of {done + result['missing_runs']} runs recorded "
            "so far; the rows show the seeds recorded (models without any are left out), and "
            "running the study again continues from the records.",
        ]
    lines += ["", *claims_lines(result, result.get("compared")), *rate_lines(result["models"])]
    lines += [
        f"![Validation loss of every run against updates and training time, "
        f"{result['description']}](images/{image})",
        "",
    ]
    return lines


def training_hours(results):
    """The reported runs' training wall time, summed over runs (all sessions of each run)."""
    seconds = 0.0
    for result in results:
        for summary in result["models"].values():
            for run in summary["runs"]:
                seconds += max((v.get("wall") or 0.0 for v in run["validations"]), default=0.0)
    return seconds / 3600


def section_markers(name=None):
    """The markers of the report's section in a document: one section per ``--section`` name
    (the unnamed one is the study's main report)."""
    if not name:
        return REPORT_START, REPORT_END
    return (REPORT_START.replace(": start", f" ({name}): start"),
            REPORT_END.replace(": end", f" ({name}): end"))  # fmt: skip


def heading(results, name=None):
    """The section's title says what stopped its runs: patience (convergence) or the cap."""
    runs = [run for result in results for s in result["models"].values() for run in s["runs"]]
    converged = sum(bool(run["converged"]) for run in runs)
    if converged == len(runs):
        title = "Study to convergence"
    elif not converged:
        title = "Study at a fixed budget (every run stopped at its cap)"
    else:
        title = f"Study to convergence or a cap ({converged} of {len(runs)} runs converged)"
    return f"## {title}" + (f" (`--section {name}`)" if name else "")


def report(results, settings, images):
    """The study's Markdown section; `images` names each corpus's curve file."""
    lines = [
        heading(results, settings.get("section")),
        "",
        f"The demo's model ({settings['model']}, 8 heads, 6 encoder and 2 decoder layers, "
        f"pre-norm) and schedule, {counted(settings['jobs'], 'run')} side by side with the cores "
        "split evenly between them. Words/s is each run's mean over its epochs, measured beside "
        "the other runs and whatever else the machine ran while it trained, so it ranks the "
        "models' speed only roughly (`benchmarks/training_throughput.py` measures them side by "
        "side). Updates to convergence: the update of the best validation loss (mean over seeds).",
        "",
    ]
    for result in results:
        lines += corpus_section(result, settings, images[result["corpus"]])
    recorded = sum(r.get("recorded_runs", 0) for r in results)
    earlier = f"; {counted(recorded, 'run')} read from records of earlier runs of the study"
    earlier = earlier if recorded else ""
    lines += [
        f"Command: `{settings['command'].strip()}` ({settings['minutes']:.0f} minutes on "
        f"{settings['machine']}{earlier}; the reported runs trained for "
        f"{training_hours(results):.1f} hours, each run's time summed).",
        "",
    ]
    return "\n".join(lines)


def replace_section(document, section, start=REPORT_START, end=REPORT_END):
    """`document` with the text between two markers replaced (markers appended if absent)."""
    block = f"{start}\n{section}\n{end}"
    if start in document and end in document:
        head, rest = document.split(start, 1)
        return head + block + rest.split(end, 1)[1]
    return document.rstrip("\n") + "\n\n" + block + "\n"


def write_report(results, settings, targets, json_path):
    """Write the curves and the report to every (markdown path, image folder) of `targets`; a
    Markdown file that exists keeps everything outside the report markers (those of
    ``settings["section"]``, the main report's without one). Returns the report."""
    name = settings.get("section")
    suffix = f"_{name}" if name else ""
    images = {r["corpus"]: f"small_scale_study_{r['corpus']}{suffix}.png" for r in results}
    section = report(results, settings, images)
    for markdown_path, image_dir in targets:
        for result in results:
            if not result["models"]:
                continue  # nothing recorded yet: no curves
            curves = {
                s["label"]: [
                    [Validation(**v) for v in run["validations"]] for run in s["runs"]
                ]
                for s in result["models"].values()
            }
            path = os.path.join(image_dir, images[result["corpus"]])
            study.plot_curves(curves, f"{result['description']}: validation loss", path)
        existing = ""
        if os.path.exists(markdown_path):
            with open(markdown_path, encoding="utf-8") as f:
                existing = f.read()
        document = replace_section(
            existing or "# Small-scale study\n", section, *section_markers(name)
        )
        atomic_write_text(markdown_path, document)
    atomic_write_text(json_path, json.dumps({"settings": settings, "corpora": results}, indent=2))
    return section
