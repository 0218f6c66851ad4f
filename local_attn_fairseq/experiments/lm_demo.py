"""The language-model demo (``make demo-lm``): fairseq's ``transformer_lm`` against
``transformer_lm_local`` with every decoder head local, on the English Bible as one long text.

1. extracts the World English Bible (Debian's ``sword-text-web``, ``data.bible``) as one
   running text: the books in canonical order, the verses of each chapter joined on one line
   (the end-of-sentence token fairseq adds to each line marks a chapter's end); whole books
   are held out, as in the translation demo: Ruth, Jonah, Philippians and Colossians for
   validation, Joshua and Romans for test;
2. trains a sentencepiece model of 4,000 pieces on the training verses and binarises the
   three texts with ``fairseq-preprocess --only-source``;
3. trains both models side by side, one core each, for the same minutes of training time
   (fairseq's ``--stop-time-hours``), on blocks of 2,048 tokens that run across verses and
   chapters (``--sample-break-mode none``): 4 layers of 256 dims with 4 heads, the local
   model's heads each attending to the token and the 64 before it (``local-64``);
4. scores each with ``fairseq-eval-lm`` on the validation and test texts, in blocks of 2,048
   tokens of which the last 1,024 are scored (``--context-window 1024``);
5. continues the first verse of the test text (Joshua 1:1) by 200 tokens with each model
   (``fairseq-interactive``, top-10 sampling with a fixed seed, one thread) and times it;
6. prints one table (training words/s, validation and test perplexity, decoding ms per
   token) and both continuations, also written to ``results.md`` and ``results.json``.

While the models train, one line per model shows its updates, loss, words/s and training
time left. Every step is skipped when its output exists; each training run lives in a folder
named by its settings and budget, a finished one is reused and an interrupted one continues
from its last checkpoint (fairseq counts the training time of every session in the budget).
``--quick`` is a smoke run: a few hundred verses, a tiny model, 20 updates each.
"""

import argparse
import hashlib
import itertools
import json
import os
import re
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Optional, Tuple

from ..checkpoint_files import UnreadableCheckpointError, read_checkpoint
from ..cli_types import positive_int
from ..data import bible
from ..data.text import (
    VocabularyTooLarge,
    encode_file,
    has_binarised,
    lines_text,
    splits_complete,
    train_sentencepiece,
    write_split_set,
)
from ..file_safety import atomic_write_text, claim_output_dir, remove_leftover_temporaries
from .demo import (
    DEFAULT_WORK_DIR,
    SPLITS,
    WORK_DIR_OWNER,
    add_work_dir,
    binarise,
    claimed_work_dir,
    train_unfinished,
)
from .fairseq_runner import (
    USER_DIR,
    RunFailed,
    TrainingJob,
    exit_on_failure,
    kept_output,
    tool_path,
    training_finished,
)
from .lm_layout import transformer_lm_layout_options
from .study import run_key
from .training_progress import RunLog, console_logging, json_log_options, parse_line, read_log

CORPUS_DIR = "bible-lm"  # inside --work-dir, beside the translation demo's bible-en-es/
DEFAULT_MINUTES = 15
LOG_INTERVAL = 10


@dataclass(frozen=True)
class Settings:
    """What a run of the demo prepares, trains and decodes; the data settings name its folder."""

    data_name: str
    books: Tuple[str, ...]  # the books read, in canonical order
    max_verses: Optional[int]  # of each split, from its start (smoke runs)
    vocab_size: int
    layers: int
    dim: int
    ffn_dim: int
    heads: int
    window: int  # how many tokens before its own each local head attends to
    tokens_per_sample: int
    context_window: int  # of fairseq-eval-lm: tokens before each scored block
    max_tokens: int
    dropout: float
    lr: float
    warmup_updates: int
    save_interval_updates: int  # an interrupted run continues from its last save
    max_update: Optional[int]  # a budget in updates (smoke runs) instead of minutes
    continuation_tokens: int


# 4 layers of 256 dims: in 15 minutes on a core each sees the training text once or twice, so
# without dropout; batches of one block make the most updates of the time.
FULL = Settings(
    data_name="data_spm4000", books=bible.BOOKS, max_verses=None, vocab_size=4000,
    layers=4, dim=256, ffn_dim=1024, heads=4, window=64,
    tokens_per_sample=2048, context_window=1024, max_tokens=2048,
    dropout=0.0, lr=3e-3, warmup_updates=50, save_interval_updates=50, max_update=None,
    continuation_tokens=200,
)  # fmt: skip
# A training book and a held-out book of each split, a few hundred verses in all; blocks of
# 128 tokens, so that a window of 16 is local within them.
QUICK = Settings(
    data_name="data_quick_spm300", books=("Genesis", "Ruth", "Joshua"), max_verses=150,
    vocab_size=300, layers=2, dim=32, ffn_dim=64, heads=4, window=16,
    tokens_per_sample=128, context_window=64, max_tokens=512,
    dropout=0.0, lr=2e-3, warmup_updates=5, save_interval_updates=10, max_update=20,
    continuation_tokens=24,
)  # fmt: skip
# Top-10 sampling at temperature 0.8, as fairseq's LM examples sample; a fixed seed.
SAMPLING = "--sampling --sampling-topk 10 --temperature 0.8 --beam 1 --nbest 1 --seed 1".split()


# ---- data ---------------------------------------------------------------------------------


def chapter_lines(verses):
    """[(book, chapter, text)]: the verses of each chapter joined into one line, in order."""
    chapters = itertools.groupby(verses, key=lambda verse: verse[0][:2])
    return [(*chapter, " ".join(text for _, text in group)) for chapter, group in chapters]


def write_texts(raw, settings):
    """``{split}.txt`` (a chapter per line) and ``{split}.ref`` (its book and chapter) of the
    three splits, ``train.verses`` (a verse per line, what sentencepiece learns from: it leaves
    out lines longer than 4,192 bytes, as many chapters are) and ``prompt.tsv`` (the first test
    verse's reference and text, the default prompt), written as one set."""
    splits = bible.split_by_book(bible.verses_in_order(books=settings.books))
    files = {}
    for split, verses in splits.items():
        lines = chapter_lines(verses[: settings.max_verses])
        files[f"{split}.txt"] = lines_text(text for _, _, text in lines)
        files[f"{split}.ref"] = lines_text(f"{book} {chapter}" for book, chapter, _ in lines)
    files["train.verses"] = lines_text(text for _, text in splits["train"][: settings.max_verses])
    (book, chapter, verse), text = splits["test"][0]
    files["prompt.tsv"] = f"{book} {chapter}:{verse}\t{text}\n"
    claim_output_dir(raw, WORK_DIR_OWNER)
    write_split_set(files, raw, WORK_DIR_OWNER)
    sizes = ", ".join(f"{split} {len(splits[split][: settings.max_verses])}" for split in SPLITS)
    print(f"| World English Bible: verses {sizes} -> {raw}", flush=True)


def segment(raw, spm_dir, vocab_size):
    """A sentencepiece model of the training verses, then each split's text encoded with it
    (``spm/{split}``, test last: its presence means every step before it is complete)."""
    os.makedirs(spm_dir, exist_ok=True)
    remove_leftover_temporaries(spm_dir)  # an interrupted encoding's
    try:
        model = train_sentencepiece(
            [os.path.join(raw, "train.verses")], os.path.join(spm_dir, "spm"), vocab_size
        )
    except VocabularyTooLarge as error:
        raise RunFailed(f"sentencepiece: {error}") from None
    for split in SPLITS:
        encode_file(model, os.path.join(raw, f"{split}.txt"), os.path.join(spm_dir, split))
    print(f"| sentencepiece: vocabulary of {vocab_size} -> {spm_dir}", flush=True)


def prepare_data(data_dir, settings):
    """Extract, segment and binarise the text in ``data_dir``, each step skipped when its
    output is complete; returns the folder of the binarised data."""
    raw, spm_dir, bin_dir = (os.path.join(data_dir, d) for d in ("raw", "spm", "bin"))
    names = [f"{s}.{ext}" for s in SPLITS for ext in ("txt", "ref")]
    names += ["train.verses", "prompt.tsv"]
    if not splits_complete(raw, names):
        try:
            write_texts(raw, settings)
        except bible.CorpusUnavailable as error:
            raise RunFailed(str(error)) from None
    if not os.path.exists(os.path.join(spm_dir, "test")):
        segment(raw, spm_dir, settings.vocab_size)
    if not has_binarised(bin_dir, "test", None):
        binarise(spm_dir, bin_dir, None, None, os.path.join(data_dir, "preprocess.log"))
    return bin_dir


def count_tokens(path):
    """Tokens fairseq reads from an encoded text: its pieces and one end-of-line per line."""
    with open(path, encoding="utf-8") as f:
        return sum(len(line.split()) + 1 for line in f)


# ---- training -----------------------------------------------------------------------------


def models(settings):
    """[(label, arch, options)]: the baseline and the model whose every head is local."""
    local = f"local-{settings.window}"
    spec = "{decoder_self: {all: [" + ", ".join([local] * settings.heads) + "]}}"
    return [
        ("transformer_lm (baseline)", "transformer_lm", []),
        (f"transformer_lm_local, every head {local}", "transformer_lm_local",
         ["--locality-config", spec]),
    ]  # fmt: skip


def training_options(settings, bin_dir, arch, extra):
    """Every fairseq-train option of one model but its budget and save folder."""
    return [
        bin_dir, "--user-dir", USER_DIR, "--arch", arch, *extra,
        "--task", "language_modeling", "--tokens-per-sample", settings.tokens_per_sample,
        "--sample-break-mode", "none",
        "--decoder-layers", settings.layers, "--decoder-embed-dim", settings.dim,
        "--decoder-ffn-embed-dim", settings.ffn_dim,
        "--decoder-attention-heads", settings.heads, "--share-decoder-input-output-embed",
        *transformer_lm_layout_options(settings.dim),
        "--dropout", settings.dropout, "--optimizer", "adam", "--adam-betas", "(0.9,0.98)",
        "--weight-decay", 0.01, "--clip-norm", 1.0, "--lr", settings.lr,
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", settings.warmup_updates,
        "--criterion", "cross_entropy", "--max-tokens", settings.max_tokens,
        "--required-batch-size-multiple", 1, "--num-workers", 0, "--seed", 1,
        # every minute of the budget trains: perplexities come from fairseq-eval-lm after
        "--disable-validation", "--no-epoch-checkpoints",
        # the last two saves kept: a run whose newest files are unreadable resumes from the one
        # before (checkpoint_files)
        "--save-interval-updates", settings.save_interval_updates, "--keep-interval-updates", 2,
    ]  # fmt: skip


def budget_options(settings, minutes):
    """(fairseq-train options, the budget in words) of each model's training."""
    if settings.max_update:
        return ["--max-update", settings.max_update], f"{settings.max_update} updates"
    return ["--stop-time-hours", minutes / 60], f"{minutes} min"


def trained_seconds(save_dir):
    """The training time fairseq counted in the budget up to the run's last checkpoint."""
    last = os.path.join(save_dir, "checkpoint_last.pt")
    if not os.path.exists(last):
        return 0.0
    try:
        state = read_checkpoint(last)
    except UnreadableCheckpointError:
        return 0.0  # only the progress line's estimate: fairseq falls back and says so
    return float((state.get("extra_state") or {}).get("previous_training_time", 0.0))


def training_job(label, options, budget, save_dir, max_seconds):
    """The job that starts or continues one run; its log grows by one session each time."""
    log = RunLog(os.path.join(save_dir, "train.log"), label, max_seconds=max_seconds)
    if max_seconds is None:
        log.max_update = budget[1]
    else:
        log.seconds_offset = trained_seconds(save_dir)
    command = [
        tool_path("fairseq-train"), *options, *budget, "--save-dir", save_dir,
        *json_log_options(LOG_INTERVAL),
    ]  # fmt: skip
    # a run's later sessions add to its log: the progress line reads where it resumes
    return TrainingJob(label, command, log, append=os.path.exists(log.path))


def train_models(bin_dir, data_dir, settings, minutes):
    """Train both models side by side, each in a folder named by its settings and budget (a
    finished run is reused); returns [(label, save folder)]."""
    budget, budget_name = budget_options(settings, minutes)
    max_seconds = None if settings.max_update else minutes * 60
    jobs, runs = [], []
    for label, arch, extra in models(settings):
        options = training_options(settings, bin_dir, arch, extra)
        save_dir = os.path.join(
            data_dir, "runs", f"{arch}-{run_key(options, data_dir)}-{budget_name.replace(' ', '')}"
        )
        runs.append((label, save_dir))
        job = training_job(label, options, budget, save_dir, max_seconds)
        if training_finished(job.log_path):
            print(f"| {label}: finished in {save_dir}, reused", flush=True)
        jobs.append(job)
    started = time.time()
    if train_unfinished(jobs, side_by_side=len(jobs)):
        print(f"| trained side by side in {time.time() - started:.0f} s", flush=True)
    return runs


def step_words_per_s(log_path):
    """Mean of the training words/s fairseq logged every LOG_INTERVAL updates (its "words" are
    tokens), over every session of the run."""
    with open(log_path, encoding="utf-8", errors="replace") as f:
        rates = [
            float(stats["wps"])
            for tag, stats in filter(None, map(parse_line, f))
            if tag == "train_inner" and "wps" in stats
        ]
    return statistics.mean(rates) if rates else float("nan")


# ---- scoring and decoding -----------------------------------------------------------------


def read_perplexity(path):
    """{"perplexity", "tokens"} that fairseq-eval-lm printed into ``path``."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    loss = re.search(r"Loss \(base 2\): ([\d.]+), Perplexity: ([\d.]+)", text)
    tokens = re.search(r"Evaluated ([\d,]+) tokens", text)
    if loss is None or tokens is None:
        raise RunFailed(f"no perplexity in {path}")
    return {"perplexity": 2 ** float(loss[1]), "tokens": int(tokens[1].replace(",", ""))}


def perplexity(bin_dir, save_dir, subset, settings):
    """fairseq-eval-lm of the run's last checkpoint on ``subset``: blocks of the training
    length, each scoring its tokens after ``context_window`` tokens of context."""
    checkpoint = os.path.join(save_dir, "checkpoint_last.pt")
    argv = [
        bin_dir, "--user-dir", USER_DIR, "--path", checkpoint, "--task", "language_modeling",
        "--gen-subset", subset, "--tokens-per-sample", settings.tokens_per_sample,
        "--context-window", settings.context_window, "--sample-break-mode", "none",
        "--max-tokens", settings.max_tokens, "--num-workers", 0,
        "--required-batch-size-multiple", 1,
    ]  # fmt: skip
    out = os.path.join(save_dir, f"eval-lm-{subset}.txt")
    # after every run has trained: nothing runs beside it
    return kept_output("fairseq-eval-lm", argv, checkpoint, out, read_perplexity, in_process=True)


def read_continuation(path):
    """{"prompt_tokens", "continuation", "ms_per_token"} from fairseq-interactive's output of
    one prompt: the tokens after the prompt's, and its decoding time over every decoding step
    (the generator steps through the prompt's tokens too, one at a time)."""
    lines = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line[:2] in ("S-", "H-", "W-", "P-"):
                lines[line[0]] = line.rstrip("\n").split("\t")
    if set(lines) != {"S", "H", "W", "P"}:
        raise RunFailed(f"no continuation in {path}")
    prompt_tokens = len(lines["S"][1].split())
    pieces = lines["H"][2].split()[prompt_tokens:]
    steps = len(lines["P"][1].split())
    return {
        "prompt_tokens": prompt_tokens,
        "continuation": "".join(pieces).replace("\u2581", " ").strip(),
        "ms_per_token": 1000 * float(lines["W"][1]) / steps,
    }


def prompt_file(data_dir, prompt):
    """The prompt as fairseq-interactive's input file, named by its text."""
    name = hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:12]
    path = os.path.join(data_dir, "prompts", f"{name}.txt")
    if not os.path.exists(path):
        atomic_write_text(path, prompt + "\n")
    return path, name


def continuation(data_dir, bin_dir, save_dir, prompt, settings):
    """fairseq-interactive of the run's last checkpoint continuing ``prompt`` by exactly
    ``continuation_tokens`` tokens (the end of a chapter is held back until then)."""
    import sentencepiece as spm

    model = os.path.join(data_dir, "spm", "spm.model")
    length = len(spm.SentencePieceProcessor(model_file=model).encode(prompt))
    length += settings.continuation_tokens
    if length >= settings.tokens_per_sample:
        raise RunFailed(
            f"--prompt: its {length - settings.continuation_tokens} tokens and the "
            f"{settings.continuation_tokens} of the continuation do not fit the model's "
            f"{settings.tokens_per_sample} positions; give a shorter prompt"
        )
    path, name = prompt_file(data_dir, prompt)
    checkpoint = os.path.join(save_dir, "checkpoint_last.pt")
    argv = [
        bin_dir, "--user-dir", USER_DIR, "--path", checkpoint, "--task", "language_modeling",
        "--input", path, "--bpe", "sentencepiece", "--sentencepiece-model", model, *SAMPLING,
        "--max-len-a", 0, "--max-len-b", length, "--min-len", length,
    ]  # fmt: skip
    out = os.path.join(save_dir, f"continuation-{name}-{settings.continuation_tokens}.txt")
    # one thread: a step's tiny products gain nothing from a second, and both models are timed
    # alike whatever else the machine runs
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return kept_output("fairseq-interactive", argv, checkpoint, out, read_continuation, env)


def first_test_verse(data_dir):
    """(reference, text) of the default prompt: the first verse of the test text (Joshua 1:1),
    which no model has seen."""
    with open(os.path.join(data_dir, "raw", "prompt.tsv"), encoding="utf-8") as f:
        reference, text = f.readline().rstrip("\n").split("\t")
    return reference, text


# ---- the demo -----------------------------------------------------------------------------


def results_table(rows):
    lines = [
        "| model | updates | train words/s | valid ppl | test ppl | decoding ms/token |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['updates']} | {r['train_words_per_s']:.0f} | "
            f"{r['valid_perplexity']:.2f} | {r['test_perplexity']:.2f} | "
            f"{r['decoding_ms_per_token']:.1f} |"
        )
    return "\n".join(lines)


def continuations_text(prompt_name, prompt, rows):
    lines = [f"Prompt ({prompt_name}): {prompt}"]
    lines += [f"\n{r['model']}:\n... {r['continuation']}" for r in rows]
    return "\n".join(lines)


def held_out_books(data_dir, split):
    """The books of a split's text, in order."""
    with open(os.path.join(data_dir, "raw", f"{split}.ref"), encoding="utf-8") as f:
        books = [line.strip().rsplit(" ", 1)[0] for line in f]
    return " and ".join(dict.fromkeys(books))


def title(settings, budget_name, test_books, tokens):
    return (
        f"World English Bible as one text ({tokens['train']:,} training tokens), test "
        f"{test_books} ({tokens['test']:,} tokens); {settings.layers} layers of {settings.dim} "
        f"dims, blocks of {settings.tokens_per_sample:,} tokens, {budget_name} of training per "
        "model"
    )


def notes(settings):
    scored = settings.tokens_per_sample - settings.context_window
    return (
        f"Perplexity per token of {settings.vocab_size:,} sentencepiece pieces, each block of "
        f"{settings.tokens_per_sample:,} tokens scoring its last {scored:,} "
        f"(fairseq-eval-lm --context-window {settings.context_window}); decoding: the prompt and "
        f"{settings.continuation_tokens} sampled tokens, one thread."
    )


def run_demo(args):
    settings = args.settings
    work = os.path.join(os.path.abspath(args.work_dir), CORPUS_DIR)
    data_dir = os.path.join(work, settings.data_name)
    started = time.time()
    bin_dir = prepare_data(data_dir, settings)
    prompt_name, prompt = ("--prompt", args.prompt) if args.prompt else first_test_verse(data_dir)
    runs = train_models(bin_dir, data_dir, settings, args.minutes)
    rows = []
    for label, save_dir in runs:
        log = read_log(os.path.join(save_dir, "train.log"))
        scores = {s: perplexity(bin_dir, save_dir, s, settings) for s in ("valid", "test")}
        decoded = continuation(data_dir, bin_dir, save_dir, prompt, settings)
        rows.append({
            "model": label, "updates": log.num_updates,
            "train_words_per_s": step_words_per_s(log.path),
            "valid_perplexity": scores["valid"]["perplexity"],
            "test_perplexity": scores["test"]["perplexity"],
            "decoding_ms_per_token": decoded["ms_per_token"],
            "continuation": decoded["continuation"], "run": os.path.relpath(save_dir, work),
        })  # fmt: skip
    tokens = {split: count_tokens(os.path.join(data_dir, "spm", split)) for split in SPLITS}
    _, budget_name = budget_options(settings, args.minutes)
    heading = title(settings, budget_name, held_out_books(data_dir, "test"), tokens)
    body = "\n\n".join(
        [results_table(rows), notes(settings), continuations_text(prompt_name, prompt, rows)]
    )
    atomic_write_text(os.path.join(work, "results.md"), f"{heading}\n\n{body}\n")
    summary = {"settings": asdict(settings), "minutes": args.minutes, "prompt": prompt,
               "tokens": tokens, "rows": rows}  # fmt: skip
    atomic_write_text(os.path.join(work, "results.json"), json.dumps(summary, indent=2) + "\n")
    print(f"\n{heading}, {(time.time() - started) / 60:.1f} min in all\n\n{body}", flush=True)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_work_dir(parser, DEFAULT_WORK_DIR, f"data, runs and results (in its {CORPUS_DIR}/)")
    parser.add_argument(
        "--minutes",
        type=positive_int,
        default=DEFAULT_MINUTES,
        help=f"training time of each model, side by side (default {DEFAULT_MINUTES}: the whole "
        "demo in 20 minutes on 2 cores)",
    )
    parser.add_argument(
        "--prompt", help="the text both models continue (default: the first test verse)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: a few hundred verses, a tiny model, 20 updates each",
    )
    args = parser.parse_args(argv)
    args.settings = QUICK if args.quick else FULL
    return args


def main(argv=None):
    args = parse_args(argv)
    console_logging()
    with claimed_work_dir(args):
        exit_on_failure(run_demo, args)
