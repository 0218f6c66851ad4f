"""The demo: real translation data, a baseline Transformer and ``transformer_local_tied``.

1. extracts the corpus chosen with ``--corpus``: ~30k English-Spanish Bible verses of ~24
   words (``bible-en-es``, the default; ``local_attn_fairseq.data.bible``), where a window has
   room to matter, or ~18k short German-English sentence pairs from Debian's Ding dictionary
   (``ding-de-en``; ``data.ding``);
2. trains a joint sentencepiece model and binarises with ``fairseq-preprocess``;
3. trains fairseq's ``transformer`` and the plugin's ``transformer_local_tied`` (Pande et al.
   config (i): every encoder head local, one Wq/Wk per layer) with ``fairseq-train``, same
   sizes and schedule;
4. scores both on the test split with ``fairseq-generate --scoring sacrebleu``;
5. prints one table (model, encoder attention parameters, BLEU, training words/s) and writes it
   to ``<work-dir>/results.md``.

While the models train, one line per model shows its epoch, updates, loss, words/s and time
left (a progress bar on a terminal, a plain line every 30 s otherwise).
Every step is skipped when its output exists, so a second run only redoes what is missing; each
step's output appears whole or not at all, so an interrupted run is redone, never taken as done.
``--epochs`` trains longer (the Bible's default fits its demo in 20 minutes on 2 cores).

The sizes, schedule, corpora and data preparation here are shared by the pruning demo, the
small-scale study and the training-throughput benchmark.
"""

import argparse
import contextlib
import functools
import json
import os
import re
import statistics
import sys
import time

from ..cli_types import positive_int
from ..data import bible, ding
from ..data.text import (
    VocabularyTooLarge,
    encode_file,
    has_binarised,
    preprocess_argv,
    splits_complete,
    train_sentencepiece,
)
from ..file_safety import (
    FolderNotOwned,
    atomic_write_text,
    check_output_dir,
    claim_output_dir,
    exit_on_os_error,
    remove_leftover_temporaries,
    staged_dir,
)
from .fairseq_runner import (
    USER_DIR,
    RunFailed,
    TrainingJob,
    exit_on_failure,
    kept_output,
    run_captured_in_process,
    tool_path,
    train_side_by_side,
    training_finished,
)
from .study import encoder_attention_parameters
from .training_progress import RunLog, console_logging, json_log_options, read_log

# Shared by both models: the paper's 8 heads and 6 encoder layers at a size that two CPU cores
# train in minutes; pre-norm and a short warm-up let it learn in few epochs.
MODEL_DIMS = (
    "--encoder-embed-dim 128 --encoder-ffn-embed-dim 256 --encoder-layers 6 "
    "--encoder-attention-heads 8 --decoder-embed-dim 128 --decoder-ffn-embed-dim 256 "
    "--decoder-layers 2 --decoder-attention-heads 8 "
    "--encoder-normalize-before --decoder-normalize-before --share-all-embeddings"
).split()
SCHEDULE = (
    "--optimizer adam --adam-betas (0.9,0.98) --lr 3e-3 --lr-scheduler inverse_sqrt "
    "--warmup-updates 300 --dropout 0.2 --weight-decay 0.0001 "
    "--criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 1024 "
    "--num-workers 0 --seed 1 --no-epoch-checkpoints --no-last-checkpoints "
    "--log-format simple --log-interval 100"
).split()
DEFAULT_VOCAB_SIZE = 4000
# The baseline is fairseq's own arch, but it is run with the plugin too: the plugin's shims are
# what let this torch load fairseq checkpoints at all.
# name -> (source, target, extraction module, description, default epochs). A Bible epoch is
# ~1,320 updates, a Ding epoch ~270. 2 Bible epochs keep the default demo within 20 minutes on a
# 2-core machine whose cores run at 60% of their best (17.0 minutes measured there).
CORPORA = {
    "ding-de-en": ("de", "en", ding, "Ding de-en", 16),
    "bible-en-es": ("en", "es", bible, "Bible en-es (WEB / Reina-Valera 1909)", 2),
}
DEFAULT_CORPUS = "bible-en-es"
DING_CORPUS = "ding-de-en"  # the corpus of the pruning demo and the training-throughput benchmark
DEFAULT_WORK_DIR = "demo_runs"  # in the current directory: the repository's when make runs it
# The owner named in the marker of a work folder. One name for the demos, the pruning demo, the
# speech demo, the study and the training-throughput benchmark: they share data folders by
# design (the pruning demo and the benchmark read the Ding demo's demo_runs/).
WORK_DIR_OWNER = "local_attn_fairseq demos"
PROGRESS_LOG_INTERVAL = 20
MODELS = [
    ("transformer (baseline)", "transformer", ["--user-dir", USER_DIR]),
    ("transformer_local_tied", "transformer_local_tied", ["--user-dir", USER_DIR]),
]
# fairseq-generate on the test split: beam 5, every sentence decoded, sentencepiece undone
GENERATE_TEST = (
    "--gen-subset test --beam 5 --batch-size 128 --max-len-a 1.2 --max-len-b 10 "
    "--remove-bpe sentencepiece --scoring sacrebleu --num-workers 0 "
    "--required-batch-size-multiple 1"
).split()
SCORES = {"BLEU": r"BLEU = ([\d.]+)", "WER": r"WER: ([\d.]+)"}
SPLITS = ("train", "valid", "test")


def corpus_work_dir(work, corpus):
    """Where a corpus's data, runs and results go: Ding's at the top of ``work`` (shared with the
    pruning demo and the benchmark), another corpus's in ``work/<corpus>``."""
    return work if corpus == DING_CORPUS else os.path.join(work, corpus)


def data_dir_for(work, vocab_size, max_train=None, test_size=None):
    """The folder of one corpus preparation, named by every setting that changes its data, so
    that a run with other settings never reuses it (nor the models trained under it)."""
    name = f"data_spm{vocab_size}" + (f"_train{max_train}" if max_train else "")
    name += f"_test{test_size}" if test_size else ""
    path = os.path.join(work, name)
    os.makedirs(path, exist_ok=True)
    return path


def prepare_data(work, corpus, vocab_size, max_train=None, test_size=None):
    """Extract, segment and binarise a corpus in ``work`` (see `data_dir_for`), each step skipped
    when its output is complete; returns the folder of the binarised data."""
    src, tgt, module, _, _ = CORPORA[corpus]
    raw, spm_dir, bin_dir = (os.path.join(work, d) for d in ("raw", "spm", "bin"))
    split_files = [f"{split}.{lang}" for split in SPLITS for lang in (src, tgt)]
    if not splits_complete(raw, split_files):  # the extraction replaces raw/ as one set
        limit = ["--max-train", str(max_train)] if max_train else []
        limit += ["--test-size", str(test_size)] if test_size else []
        module.main(["--out-dir", raw, *limit])
    # Each encoding is renamed into place whole and test.<tgt> comes last: its presence means
    # this run's model and every encoding before it are complete.
    if not os.path.exists(os.path.join(spm_dir, f"test.{tgt}")):
        segment(raw, spm_dir, src, tgt, vocab_size)
    if not has_binarised(bin_dir, "test", src, tgt):
        binarise(spm_dir, bin_dir, src, tgt, os.path.join(work, "preprocess.log"))
    return bin_dir


def segment(raw, spm_dir, src, tgt, vocab_size):
    """A joint sentencepiece model of the training split, then every split encoded with it."""
    os.makedirs(spm_dir, exist_ok=True)
    remove_leftover_temporaries(spm_dir)  # an interrupted encoding's
    try:
        model = train_sentencepiece(
            [f"{raw}/train.{src}", f"{raw}/train.{tgt}"], os.path.join(spm_dir, "spm"), vocab_size
        )
    except VocabularyTooLarge as error:  # a small --max-train: the user's to fix, one line
        sys.exit(
            f"error: --vocab-size {vocab_size}: the training data allows at most "
            f"{error.largest}; pass --vocab-size {error.largest} or less, or more --max-train"
        )
    for split in SPLITS:
        for lang in (src, tgt):
            encode_file(model, f"{raw}/{split}.{lang}", f"{spm_dir}/{split}.{lang}")
    print(f"| sentencepiece: joint vocabulary of {vocab_size} -> {spm_dir}")


def binarise(spm_dir, bin_dir, src, tgt, log_path):
    """fairseq-preprocess of the encoded splits into ``bin_dir``, built in ``bin_dir.partial``
    and swapped in whole, so that an interrupted run leaves no dictionary or partial .bin."""
    try:
        check_output_dir(bin_dir, WORK_DIR_OWNER)
    except FolderNotOwned:
        raise FolderNotOwned(
            f"{bin_dir!r} holds an unfinished fairseq-preprocess output that the demos did not "
            "mark as theirs (left by an earlier version): delete it and run again"
        ) from None
    prefixes = {split: f"{spm_dir}/{split}" for split in SPLITS}
    with staged_dir(bin_dir, WORK_DIR_OWNER) as staging:
        # in this process: nothing trains yet, and a child would spend 5 s importing fairseq
        run_captured_in_process(
            "fairseq-preprocess", preprocess_argv(src, tgt, prefixes, staging, joined=True),
            log_path,
        )  # fmt: skip


def model_dir(data_dir, arch, epochs):
    """A model's run folder, inside the folder of the data it trains on: runs on other data
    settings (vocabulary, training pairs, test split) are other folders, never reused."""
    return os.path.join(data_dir, f"{arch}_e{epochs}")


def training_job(label, bin_dir, options, epochs, save_dir):
    """fairseq-train of one demo model for ``epochs`` epochs into ``save_dir``, logging what its
    progress line reads."""
    command = [
        tool_path("fairseq-train"), bin_dir, *options, "--max-epoch", epochs,
        "--save-dir", save_dir, *json_log_options(PROGRESS_LOG_INTERVAL),
    ]  # fmt: skip
    log_path = os.path.join(save_dir, "train.log")
    return TrainingJob(label, command, RunLog(log_path, label, max_epoch=epochs))


def train_unfinished(jobs, side_by_side):
    """Train the jobs whose runs have not finished, the cores split as for ``side_by_side`` runs
    (so a model's words/s are measured on the same share of the machine when others are reused);
    returns the jobs trained."""
    unfinished = [job for job in jobs if not training_finished(job.log_path)]
    train_side_by_side(unfinished, parallel=side_by_side)
    return unfinished


def train_all(bin_dir, data_dir, epochs):
    """Train every model at once, the cores split between them; returns (checkpoint, log) each.

    Small models use two threads poorly, so side by side they finish sooner than one after
    the other, and both see the same machine while their words/s are measured.
    """
    jobs = [
        training_job(
            label, bin_dir, ["--arch", arch, *extra, *MODEL_DIMS, *SCHEDULE], epochs,
            model_dir(data_dir, arch, epochs),
        )  # fmt: skip
        for label, arch, extra in MODELS
    ]
    started = time.time()
    train_unfinished(jobs, side_by_side=len(MODELS))
    print(f"| trained {len(MODELS)} models side by side in {time.time() - started:.0f} s")
    return [(checkpoint_of(job), job.log_path) for job in jobs]


def checkpoint_of(job, name="checkpoint_best.pt"):
    return os.path.join(os.path.dirname(job.log_path), name)


def words_per_second(log_path):
    """Mean of the per-epoch target words/s fairseq reports, leaving out the warm-up epoch
    (fairseq's JSON log lines, or its simple format in a log written before those)."""
    rates = read_log(log_path).epoch_words_per_s
    if not rates:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        rates = [float(x) for x in re.findall(r"\| train \| epoch \d+ .*?\| wps ([\d.]+)", text)]
    if not rates:
        return float("nan")
    return statistics.mean(rates[1:] if len(rates) > 1 else rates)


def generated_score(log_path, metric="BLEU"):
    """The corpus score (BLEU or WER) that fairseq-generate printed into ``log_path``."""
    with open(log_path, encoding="utf-8", errors="replace") as f:
        match = re.search(SCORES[metric], f.read())
    if match is None:
        raise RunFailed(f"no {metric} score in {log_path}")
    return float(match.group(1))


def decode_and_score(argv, checkpoint, out_path, metric="BLEU", in_process=False):
    """fairseq-generate ``argv`` of ``checkpoint``, its output kept in ``out_path`` and reused
    while it is newer than the checkpoint (``fairseq_runner.kept_output``, ``in_process`` too);
    returns its score."""
    read = functools.partial(generated_score, metric=metric)
    return kept_output("fairseq-generate", argv, checkpoint, out_path, read, in_process=in_process)


def bleu(bin_dir, checkpoint, out_path, in_process=False):
    """sacreBLEU of ``checkpoint`` on the test split, every sentence scored; the output of
    fairseq-generate is kept in ``out_path`` while it is newer than the checkpoint."""
    argv = [bin_dir, "--user-dir", USER_DIR, "--path", checkpoint, *GENERATE_TEST]
    return decode_and_score(argv, checkpoint, out_path, in_process=in_process)


def results_table(rows):
    lines = [
        "| model | encoder attention params | BLEU (test) | train words/s |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['encoder_attention_params'] / 1e6:.3f}M | "
            f"{r['bleu']:.2f} | {r['train_words_per_s']:.0f} |"
        )
    return "\n".join(lines)


def add_work_dir(parser, default, holds):
    """--work-dir: a folder of the current directory by default (the repository's under make),
    and --overwrite to write into a folder that the demos did not create (see claimed_work_dir)."""
    where = "" if os.path.isabs(default) else " in the current directory"
    help = f"{holds} (default: {default}/{where})"
    parser.add_argument("--work-dir", default=default, help=help)
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --work-dir that the demos did not create (nothing in it "
        "is deleted; files of the same names are replaced)",
    )


@contextlib.contextmanager
def claimed_work_dir(args):
    """Claim ``args.work_dir`` for the demos before any work, and end the program with one line
    naming --work-dir for a refused or unusable folder (a path under a regular file, no
    permission), then or during the work that follows in the block."""
    folder = os.path.abspath(args.work_dir)
    with exit_on_os_error("--work-dir"):
        # Folders created on the way are the demos' too: the speech demo's demo_runs/speech,
        # made first, must leave a demo_runs/ that the text demo may use.
        missing = []
        parent = os.path.dirname(folder)
        while not os.path.lexists(parent) and parent != os.path.dirname(parent):
            missing.append(parent)
            parent = os.path.dirname(parent)
        for created in reversed(missing):
            claim_output_dir(created, WORK_DIR_OWNER)
        claim_output_dir(folder, WORK_DIR_OWNER, args.overwrite)
        yield


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_work_dir(parser, DEFAULT_WORK_DIR, "data, runs and results")
    parser.add_argument(
        "--corpus",
        choices=sorted(CORPORA),
        default=DEFAULT_CORPUS,
        help="bible-en-es: Bible verses of ~24 words (default); ding-de-en: short dictionary "
        "sentences of ~8 words",
    )
    parser.add_argument(
        "--epochs",
        type=positive_int,
        default=os.environ.get("DEMO_EPOCHS") or None,  # a string default goes through the type
        help="training epochs per model (env DEMO_EPOCHS; default 2 for bible-en-es, "
        "16 for ding-de-en); more trains longer",
    )
    parser.add_argument("--vocab-size", type=positive_int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument(
        "--max-train",
        type=positive_int,
        default=None,
        help="train on this many pairs only (quick smoke runs; use a new --work-dir)",
    )
    parser.add_argument(
        "--test-size",
        type=positive_int,
        default=None,
        help="test sentences (default: the corpus's test split; quick smoke runs)",
    )
    args = parser.parse_args(argv)
    args.epochs = args.epochs or CORPORA[args.corpus][4]
    return args


def run_demo(args):
    _, tgt, _, corpus_name, _ = CORPORA[args.corpus]
    work = corpus_work_dir(os.path.abspath(args.work_dir), args.corpus)
    data_dir = data_dir_for(work, args.vocab_size, args.max_train, args.test_size)
    started = time.time()
    bin_dir = prepare_data(data_dir, args.corpus, args.vocab_size, args.max_train, args.test_size)
    with open(os.path.join(data_dir, "raw", f"test.{tgt}"), encoding="utf-8") as f:
        test_size = sum(1 for _ in f)

    rows = []
    trained = train_all(bin_dir, data_dir, args.epochs)
    for (label, _, _), (checkpoint, log) in zip(MODELS, trained):
        generated = os.path.join(os.path.dirname(checkpoint), "generate-test.txt")
        rows.append(
            {
                "model": label,
                "encoder_attention_params": encoder_attention_parameters(checkpoint),
                "bleu": bleu(bin_dir, checkpoint, generated, in_process=True),  # all trained
                "train_words_per_s": words_per_second(log),
            }
        )

    table = results_table(rows)
    title = f"{corpus_name} test ({test_size} sentences), {args.epochs} epochs per model"
    atomic_write_text(os.path.join(work, "results.md"), f"{title}\n\n{table}\n")
    atomic_write_text(
        os.path.join(work, "results.json"),
        json.dumps({"corpus": args.corpus, "epochs": args.epochs, "rows": rows}, indent=2),
    )
    print(f"\n{title}, {(time.time() - started) / 60:.1f} min\n")
    print(table)


def main(argv=None):
    args = parse_args(argv)
    console_logging()
    with claimed_work_dir(args):
        exit_on_failure(run_demo, args)
