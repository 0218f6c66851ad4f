"""The speech demo: the speech study in quick form, on spoken Bible verses (``make demo-speech``).

Alastruey et al. (2022)'s recipe end to end on the CPU, through the speech study's steps
(``experiments.speech_study``), sized for about 45 minutes of a 2-core machine:

1. speaks the English side of the Bible verse pairs of at most 16 words with espeak-ng, the
   first 4,000 training verses; dev and test are the study's held-out books (test: Joshua and
   Romans), spoken by a voice training never hears; 80-dim filterbanks, MuST-C's layout;
2. pre-trains an ASR model (``s2t_transformer_local_tiny`` at width 128, every encoder layer
   global, fairseq's CTC loss beside the decoder's);
3. runs the contributions analysis on its encoder: Algorithm 1's window per layer;
4. trains the two ST arms side by side, both with the ASR encoder: global, and local with
   those windows;
5. scores WER and BLEU on the test books, and the two levels that say whether ST learnt to
   translate: BLEU of the global model before training (the ASR encoder, a new decoder), and
   BLEU of each trained model on the test audio shuffled across verses (what the decoder gets
   from the Spanish it has learnt alone, without listening);
6. prints one table (also ``<work-dir>/results.md`` and ``results.json``) and writes the study's
   report with learning curves (``<work-dir>/speech_study.md``).

A progress line per run shows its updates, loss and time left while it trains. Every step is
skipped when its output exists; a run interrupted part-way continues from its last checkpoint.
``--quick`` is a smoke run (a few dozen verses, a few updates) that checks the pipeline.
"""

import argparse
import json
import os
import time
from dataclasses import asdict, replace

from ..cli_types import positive_int
from ..data import bible
from ..file_safety import atomic_write_text
from . import speech_pipeline, speech_study
from .demo import add_work_dir, claimed_work_dir
from .fairseq_runner import exit_on_failure
from .speech_study_report import ARMS, corpus_facts, speech_length, window_list, write_report
from .training_progress import console_logging

DEFAULT_WORK_DIR = os.path.join("demo_runs", "speech")
# Short verses: more of them in a batch of frames, and an ASR model that follows the audio
# within the budget. Caps instead of convergence: the demo shows learning, the study measures.
DEMO = speech_study.Sizes(
    max_words=16, train=4000, dev=None, test=None, vocab=1000, asr_max_update=1500,
    st_max_update=1000, model_dim=128, timing_rounds=2,
)  # fmt: skip
QUICK = replace(speech_study.TINY, model_dim=32)
SEED = 1


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_work_dir(parser, DEFAULT_WORK_DIR, "corpus, runs and results")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: a few dozen verses, a few updates a run"
    )
    parser.add_argument("--train-size", type=positive_int,
                        help=f"training verses (default {DEMO.train:,})")  # fmt: skip
    parser.add_argument("--asr-max-update", type=positive_int,
                        help=f"updates of the ASR model (default {DEMO.asr_max_update:,})")
    parser.add_argument("--st-max-update", type=positive_int,
                        help=f"updates of each ST model (default {DEMO.st_max_update:,})")
    parser.add_argument("--workers", type=positive_int, default=2,
                        help="speech synthesis and feature processes")  # fmt: skip
    args = parser.parse_args(argv)
    overrides = {
        "train": args.train_size, "asr_max_update": args.asr_max_update,
        "st_max_update": args.st_max_update,
    }  # fmt: skip
    args.sizes = replace(QUICK if args.quick else DEMO,
                         **{k: v for k, v in overrides.items() if v is not None})  # fmt: skip
    # the study's settings the demo fixes: one seed, both ST arms side by side
    args.seed_list, args.jobs, args.patience = [SEED], 2, 3
    args.records, args.report_only, args.write_docs = None, False, False
    return args


def control_levels(outcome):
    """{arm: (BLEU before training or None, BLEU on the test audio shuffled across verses)}:
    the global arm scored before training, each arm's shuffled level read from its record (or
    scored, for a record written before records held it)."""
    records = {record["arm"]: record for record in outcome.st_records}
    levels = {}
    for run in outcome.st_runs:
        arm = speech_study.arm_of(run)
        untrained = None
        if arm == "global":
            initial = speech_pipeline.write_initial_checkpoint(
                os.path.join(run.save_dir, "checkpoint_best.pt"),
                os.path.join(run.save_dir, "initial", "checkpoint_initial.pt"),
                run.option("--load-pretrained-encoder-from"),
            )
            untrained = speech_pipeline.score(
                outcome.data.data, initial, "st",
                os.path.join(run.save_dir, "test", "generate-tst-COMMON-untrained.txt"),
            )  # fmt: skip
        shuffled = records[arm].get("shuffled_audio_score")
        if shuffled is None:
            shuffled = speech_study.shuffled_audio_score(outcome.data, run)
        levels[arm] = (untrained, shuffled)
    return levels


def results_rows(outcome, levels):
    asr = outcome.asr_record
    rows = [{"model": "ASR (global)", "windows": asr["windows"], "metric": "WER",
             "score": asr["score"]}]  # fmt: skip
    for record in outcome.st_records:
        arm = record["arm"]
        untrained, shuffled = levels[arm]
        if untrained is not None:
            rows.append({"model": f"{ARMS[arm]}, before training", "windows": record["windows"],
                         "metric": "BLEU", "score": untrained})  # fmt: skip
        rows.append({"model": ARMS[arm], "windows": record["windows"], "metric": "BLEU",
                     "score": record["score"]})  # fmt: skip
        rows.append({"model": f"{ARMS[arm]}, test audio shuffled across verses",
                     "windows": record["windows"], "metric": "BLEU", "score": shuffled})
    return rows


def results_table(rows):
    lines = ["| model | encoder attention windows | test |", "|---|---|---:|"]
    lines += [f"| {r['model']} | {r['windows']} | {r['metric']} {r['score']:.2f} |" for r in rows]
    return "\n".join(lines)


def cost_line(cost):
    """Local against global encoder self-attention at the corpus's mean length."""
    local, global_ = cost["arms"]["local"], cost["arms"]["global"]
    timing = cost["timing"]
    return (
        f"Encoder self-attention of the local arm at the mean length ({cost['mean_fbank_frames']} "
        f"frames): {local['flops_at_mean'] / global_['flops_at_mean']:.2f}x the global arm's "
        f"operations, {local['weight_bytes_at_mean'] / global_['weight_bytes_at_mean']:.2f}x its "
        f"attention weights; encoder forward + backward "
        f"{timing['local']['seconds'] / timing['global']['seconds']:.2f}x its time "
        f"(batch of {timing['batch']}, this machine)."
    )


def title(outcome, sizes):
    facts = corpus_facts(outcome.data)
    return (
        f"Spoken Bible en-es (espeak-ng): {sizes.train:,} training verses of at most "
        f"{sizes.max_words} words ({speech_length(facts['train']['hours'])} of speech); test: "
        f"{facts['tst-COMMON']['utterances']} verses of "
        f"{' and '.join(bible.TEST_BOOKS)} in a voice training never hears; width "
        f"{sizes.model_dim}, ASR {sizes.asr_max_update:,} updates, ST {sizes.st_max_update:,} "
        "updates each"
    )


def run_demo(args):
    work = os.path.abspath(args.work_dir)
    started = time.time()
    outcome = speech_study.run_steps(args)
    levels = control_levels(outcome)
    rows = results_rows(outcome, levels)
    settings = speech_study.report_settings(args, None, started, "scripts/demo_speech.py")
    write_report(outcome.data, args.sizes, settings, outcome.asr_record, outcome.st_records,
                 outcome.cost, [(work, os.path.join(work, "images"), False)])  # fmt: skip
    text = "\n\n".join([title(outcome, args.sizes), results_table(rows), cost_line(outcome.cost)])
    atomic_write_text(os.path.join(work, "results.md"), text + "\n")
    windows = window_list(outcome.asr_record["chosen_windows"])
    summary = {"sizes": asdict(args.sizes), "windows": windows, "rows": rows, "cost": outcome.cost}
    atomic_write_text(os.path.join(work, "results.json"), json.dumps(summary, indent=2) + "\n")
    minutes = (time.time() - started) / 60
    print(f"\n{text}\n\n{minutes:.1f} min; report with learning curves: "
          f"{os.path.join(work, 'speech_study.md')}")  # fmt: skip


def main(argv=None):
    args = parse_args(argv)
    console_logging()
    with claimed_work_dir(args):  # the demos' owner: demo_runs/speech is inside demo_runs/
        exit_on_failure(run_demo, args)
