"""A small-scale study of every mechanism, each model trained until it converges.

The baseline and each paper's headline model are trained with the demo's sizes and schedule
(``experiments.demo``) on one or both corpora (``--corpus``: Ding German-English dictionary
sentences of ~8 words, Bible English-Spanish verses of ~24 words), with several seeds, each run
until validation loss (one validation per epoch) has not improved for ``--patience``
validations or ``--max-update`` updates are done; the checkpoint with the best validation loss
is scored on the test split. The gated model (Voita et al.) trains with its gates and the L0
penalty from the start and is scored after pruning.

Runs are resumable and keyed by their settings: each lives in ``WORK/<corpus>/runs/<model>-<hash
of its fairseq options>``; killing the study and running the same command again continues every
unfinished run from its last checkpoint and reuses finished ones; a larger ``--max-update``
continues runs stopped by the smaller one. Each run is scored as soon as it is finished, and its
result (BLEU, speed, validation curve; no checkpoint) recorded in ``--records`` (default
``WORK/records``) under a key that is the same on any machine: a study pointed at records of
earlier sessions reads the runs recorded there under the same budget and trains only the rest,
so a study longer than one session is carried on by keeping its records (the repository's are
in ``docs/small_scale_study_records/``; a study under another budget is refused a --records
folder that records its runs under this one, and keeps its records in a folder of its own). While runs train, one live line per run shows its
epoch, updates, loss, words/s and time left. ``--jobs N`` trains N runs side by side with the
cores split between them (small models use two threads poorly).

The report (BLEU mean +- std over seeds, updates to convergence, words/s, learning curves
against updates and against training time) goes to ``WORK/small_scale_study.md`` and
``WORK/images/``; ``--write-docs`` also puts it in ``docs/small_scale_study.md`` (between its
report markers; the rest of that file is kept) and ``docs/images/``. ``WORK`` (``--work-dir``,
default ``study_runs``) and ``docs`` are folders of the current directory: run it from the
repository.

Budget of the full study (defaults: 6 models x 3 seeds x 2 corpora = 36 runs, --jobs 2 on this
2-core machine), about 8 hours. Measured training speed of one run with two side by side: Ding
3,906 target words/s at ~620 per update (the Ding demo, docs/demo.md): 0.16 s per update; Bible
~3,700 words/s at ~770 per update (the Bible demo): 0.21 s per update. With 30% more for the
validations, decoding, start-up and the slower dynamic-window model (0.74x the baseline's
words/s), the caps give at most
  Ding:  18 runs x 5,000 updates (~18 epochs of 16,635 pairs) x 0.16 s x 1.3 = 5.2 run-hours,
  Bible: 18 runs x 8,000 updates (~15 epochs of 12,000 pairs) x 0.21 s x 1.3 = 10.9 run-hours,
16.1 run-hours / 2 jobs = 8.1 hours, less where patience stops a run first.

    python scripts/small_scale_study.py --corpus ding-de-en,bible-en-es --jobs 2
    python scripts/small_scale_study.py --jobs 2 --records docs/small_scale_study_records \
        --write-docs   # the repository's study, continued from its records
"""

import argparse
import os
import sys
import time

from ..cli_types import non_negative_int, positive_int
from . import demo, study
from .fairseq_runner import USER_DIR, exit_on_failure
from .study_report import StudyCorpus, recorded_result, run_corpus, write_report
from .training_progress import console_logging

# --tiny: the demo's layers and heads at widths that make a smoke run of the study quick
TINY_WIDTHS = (
    "--encoder-embed-dim 32 --encoder-ffn-embed-dim 64 --decoder-embed-dim 32 "
    "--decoder-ffn-embed-dim 64"
).split()
DEFAULT_WORK_DIR = "study_runs"
DOCS = "docs"  # the repository's documentation, when run from the repository
# Per corpus: the cap on updates and the training pairs used (None: all); see the budget above.
BUDGETS = {
    "ding-de-en": {"max_update": 5000, "max_train": None},
    "bible-en-es": {"max_update": 8000, "max_train": 12000},
}


def study_schedule():
    """The demo's schedule without its seed (each run has its own) and with the last
    checkpoint kept (resuming needs it)."""
    return study.without_options(demo.SCHEDULE, {"--seed": 1, "--no-last-checkpoints": 0})


def section_name(text):
    """An argparse ``type`` for --section: it names markers and files, so letters, digits, -
    and _ only."""
    if not text or not all(c.isalnum() or c in "-_" for c in text):
        raise argparse.ArgumentTypeError(f"{text!r}: use letters, digits, '-' and '_' only")
    return text


def seed_list(text):
    """An argparse ``type`` for --seeds: distinct non-negative whole numbers, comma-separated.
    fairseq refuses a negative seed only after the data is prepared, and a seed given twice
    would be one run counted twice in the mean over seeds."""
    seeds = []
    for item in text.split(","):
        seed = non_negative_int(item.strip())  # its ArgumentTypeError names the bad value
        if seed in seeds:
            raise argparse.ArgumentTypeError(f"seed {seed} is given twice")
        seeds.append(seed)
    return seeds


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_work_dir(parser, DEFAULT_WORK_DIR, "runs and report")
    parser.add_argument(
        "--corpus",
        default="ding-de-en,bible-en-es",
        help=f"comma-separated corpora among {', '.join(demo.CORPORA)} (default: both)",
    )
    parser.add_argument(
        "--max-update",
        type=positive_int,
        help="cap on the updates of a run (default: "
        + ", ".join(f"{c} {b['max_update']}" for c, b in BUDGETS.items())
        + ")",
    )
    parser.add_argument(
        "--patience",
        type=non_negative_int,
        default=3,
        help="stop a run when validation loss has not improved for this many validations "
        "(one per epoch; default 3)",
    )
    parser.add_argument(
        "--seeds",
        type=seed_list,
        default="1,2,3",
        help="comma-separated training seeds: distinct whole numbers, 0 or more",
    )
    parser.add_argument(
        "--models",
        default=",".join(study.MODELS),
        help="comma-separated, among the study's models (default: all of them: "
        f"{', '.join(study.MODELS)}) and its ablations ({', '.join(study.ABLATIONS)})",
    )
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        help="runs side by side, the cores split between them",
    )
    parser.add_argument("--vocab-size", type=positive_int, default=demo.DEFAULT_VOCAB_SIZE)
    parser.add_argument(
        "--max-train",
        type=positive_int,
        help="training pairs (default: "
        + ", ".join(f"{c} {b['max_train'] or 'all'}" for c, b in BUDGETS.items())
        + ")",
    )
    parser.add_argument(
        "--test-size",
        type=positive_int,
        help="test sentences (default: the corpus's whole test split)",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="32-dim models: a smoke run of the script, no study"
    )
    parser.add_argument(
        "--records",
        help="folder of the finished runs' records, read and added to (default: WORK/records)",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: report the runs recorded so far (a study in progress)",
    )
    parser.add_argument(
        "--section",
        type=section_name,
        help="report into its own section of the documents (markers, curves and JSON named "
        "after it) instead of the main report: e.g. 'convergence' for runs under a higher cap",
    )
    parser.add_argument(
        "--compare-records",
        help="a folder of records of the same study under another budget (--compare-max-update): "
        "each claim's verdict there is shown beside this study's",
    )
    parser.add_argument(
        "--compare-max-update", type=positive_int, help="the cap of the --compare-records runs"
    )
    parser.add_argument(
        "--write-docs",
        action="store_true",
        help="also write the report into docs/small_scale_study.md and docs/images/ of the "
        "current directory (the repository's)",
    )
    args = parser.parse_args(argv)
    args.corpora = args.corpus.split(",")
    for option, values, known in (
        ("--models", args.models.split(","), study.RUNNABLE),
        ("--corpus", args.corpora, demo.CORPORA),
    ):
        unknown = set(values) - set(known)
        if unknown:
            names = ", ".join(sorted(unknown))
            parser.error(f"{option}: unknown {names} (known: {', '.join(known)})")
    if (args.compare_records is None) != (args.compare_max_update is None):
        parser.error("--compare-records and --compare-max-update go together")
    args.seed_list = args.seeds
    return args


def prepare(corpus, work, args, max_train):
    """The corpus binarised for fairseq, in a data folder named after its settings."""
    data_dir = demo.data_dir_for(work, args.vocab_size, max_train, args.test_size)
    bin_dir = demo.prepare_data(data_dir, corpus, args.vocab_size, max_train, args.test_size)
    src, tgt, _, description, _ = demo.CORPORA[corpus]
    counts = {}
    for split in ("train", "test"):
        with open(os.path.join(data_dir, "raw", f"{split}.{tgt}"), encoding="utf-8") as f:
            counts[split] = sum(1 for _ in f)
    return StudyCorpus(corpus, description, bin_dir, counts["train"], counts["test"])


def base_argv(args):
    """The fairseq-train options every run of the study shares (the model's come after)."""
    return [
        "--user-dir", USER_DIR, *demo.MODEL_DIMS, *(TINY_WIDTHS if args.tiny else []),
        *study_schedule(),
    ]  # fmt: skip


def run_study(args, argv):
    """Every corpus prepared, its runs trained and scored; the report written and printed."""
    work = os.path.abspath(args.work_dir)
    started = time.time()
    base = base_argv(args)
    records = os.path.abspath(args.records or os.path.join(work, "records"))
    results = []
    for corpus in args.corpora:
        corpus_dir = os.path.join(work, corpus)
        max_update = args.max_update or BUDGETS[corpus]["max_update"]
        data = prepare(corpus, corpus_dir, args, args.max_train or BUDGETS[corpus]["max_train"])
        result = run_corpus(
            data, corpus_dir, base, args.models.split(","), args.seed_list,
            max_update, args.patience, args.jobs, records, train=not args.report_only,
            own_records=args.records is None,
        )  # fmt: skip
        if args.compare_records:
            result["compared"] = recorded_result(
                data, corpus_dir, base, args.models.split(","),
                os.path.abspath(args.compare_records), args.compare_max_update, args.patience,
            )  # fmt: skip
        results.append(dict(result, max_update=max_update))
    settings = {
        "command": "python scripts/small_scale_study.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "minutes": (time.time() - started) / 60,
        "machine": f"{os.cpu_count()} CPU cores",
        "model": "32 dims (--tiny)" if args.tiny else "128 dims",
        "patience": args.patience,
        "seeds": args.seed_list,
        "jobs": args.jobs,
        "section": args.section,
    }
    targets = [(os.path.join(work, "small_scale_study.md"), os.path.join(work, "images"))]
    if args.write_docs:
        docs = os.path.abspath(DOCS)
        targets.append((os.path.join(docs, "small_scale_study.md"), os.path.join(docs, "images")))
    report_json = f"small_scale_study{'_' + args.section if args.section else ''}.json"
    text = write_report(results, settings, targets, os.path.join(work, report_json))
    print(text)
    print("(written to " + ", ".join(md for md, _ in targets) + ")")


def main(argv=None):
    args = parse_args(argv)
    console_logging()
    # the demos' owner: the study prepares its data as the demos do, and may share their folder
    with demo.claimed_work_dir(args):
        exit_on_failure(run_study, args, argv)
