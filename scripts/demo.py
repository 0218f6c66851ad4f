#!/usr/bin/env python3
"""The demo: real translation data, a baseline Transformer and ``transformer_local_tied``.

1. extracts the corpus chosen with ``--corpus``: ~18k short German-English sentence pairs from
   Debian's Ding dictionary (``ding-de-en``, the default; ``scripts/prepare_ding.py``) or ~31k
   English-Spanish Bible verses of ~24 words (``bible-en-es``; ``scripts/prepare_bible.py``);
2. trains a joint sentencepiece model and binarises with ``fairseq-preprocess``;
3. trains fairseq's ``transformer`` and the plugin's ``transformer_local_tied`` (Pande et al.
   config (i): every encoder head local, one Wq/Wk per layer) with ``fairseq-train``, same
   sizes and schedule;
4. scores both on the test split with ``fairseq-generate --scoring sacrebleu``;
5. prints one table (model, encoder attention parameters, BLEU, training words/s) and writes it
   to ``<work-dir>/results.md``.

While the models train, one line per model shows its epoch, updates, loss, words/s and time
left (a progress bar on a terminal, a plain line every 30 s otherwise).
Every step is skipped when its output exists, so a second run only redoes what is missing.
``--epochs`` trains longer (the default fits the Ding demo in about 20 minutes on 2 cores).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

from local_attn_fairseq.experiments.study import encoder_attention_parameters
from local_attn_fairseq.experiments.training_progress import (
    ProgressDisplay,
    RunLog,
    console_logging,
    json_log_options,
    read_log,
    wait_with_progress,
)
from local_attn_fairseq.file_safety import atomic_write_text

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_DIR = os.path.join(ROOT, "local_attn_fairseq")
BIN = os.path.dirname(sys.executable)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from text_data import encode_file, train_sentencepiece  # noqa: E402

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
# name -> (source, target, extraction script, description, default epochs). A Bible epoch is
# ~1,300 updates, a Ding epoch ~270: 3 Bible epochs are about as many updates as 16 Ding ones.
CORPORA = {
    "ding-de-en": ("de", "en", "prepare_ding.py", "Ding de-en", 16),
    "bible-en-es": ("en", "es", "prepare_bible.py", "Bible en-es (WEB / Reina-Valera 1909)", 3),
}
DEFAULT_CORPUS = "ding-de-en"
PROGRESS_LOG_INTERVAL = 20
MODELS = [
    ("transformer (baseline)", "transformer", ["--user-dir", USER_DIR]),
    ("transformer_local_tied", "transformer_local_tied", ["--user-dir", USER_DIR]),
]


def run(cmd, log_path=None):
    cmd = [str(c) for c in cmd]
    print("$ " + " ".join(cmd), flush=True)
    if log_path is None:
        subprocess.run(cmd, check=True)
        return None
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    text = open(log_path).read()
    if proc.returncode != 0:
        sys.exit(f"command failed ({proc.returncode}), see {log_path}:\n{text[-3000:]}")
    return text


def training_finished(save_dir):
    """Whether fairseq-train ran to its end in ``save_dir``: an interrupted run leaves the
    checkpoint_best.pt of some epoch behind, so only the last words of its log count."""
    log = os.path.join(save_dir, "train.log")
    if not os.path.exists(log):
        return False
    with open(log, encoding="utf-8", errors="replace") as f:
        return "done training in" in f.read()


def up_to_date(output, source):
    """Whether ``output`` exists and was written after ``source``: a score or an analysis of a
    checkpoint that was trained again since is stale."""
    return os.path.exists(output) and os.path.getmtime(output) >= os.path.getmtime(source)


def corpus_work_dir(work, corpus):
    """The Ding demo's folders stay where they always were; another corpus gets a subfolder."""
    return work if corpus == DEFAULT_CORPUS else os.path.join(work, corpus)


def data_dir_for(work, vocab_size, max_train=None):
    name = f"data_spm{vocab_size}" + (f"_train{max_train}" if max_train else "")
    path = os.path.join(work, name)
    os.makedirs(path, exist_ok=True)
    return path


def prepare_data(work, vocab_size, max_train=None, test_size=None, corpus=DEFAULT_CORPUS):
    src, tgt, script, _, _ = CORPORA[corpus]
    raw, spm_dir, bin_dir = (os.path.join(work, d) for d in ("raw", "spm", "bin"))
    if not os.path.exists(os.path.join(raw, f"test.{tgt}")):
        limit = ["--max-train", str(max_train)] if max_train else []
        limit += ["--test-size", str(test_size)] if test_size else []
        run([sys.executable, os.path.join(ROOT, "scripts", script), "--out-dir", raw, *limit])
    if not os.path.exists(os.path.join(spm_dir, f"test.{tgt}")):
        os.makedirs(spm_dir, exist_ok=True)
        model = train_sentencepiece(
            [f"{raw}/train.{src}", f"{raw}/train.{tgt}"], os.path.join(spm_dir, "spm"), vocab_size
        )
        for split in ("train", "valid", "test"):
            for lang in (src, tgt):
                encode_file(model, f"{raw}/{split}.{lang}", f"{spm_dir}/{split}.{lang}")
        print(f"| sentencepiece: joint vocabulary of {vocab_size} -> {spm_dir}")
    if not os.path.exists(os.path.join(bin_dir, f"test.{src}-{tgt}.{tgt}.bin")):
        run(
            [
                os.path.join(BIN, "fairseq-preprocess"),
                "--source-lang",
                src,
                "--target-lang",
                tgt,
                "--trainpref",
                f"{spm_dir}/train",
                "--validpref",
                f"{spm_dir}/valid",
                "--testpref",
                f"{spm_dir}/test",
                "--destdir",
                bin_dir,
                "--joined-dictionary",
                "--workers",
                "2",
            ],
            log_path=os.path.join(work, "preprocess.log"),
        )
    return bin_dir


def train_all(bin_dir, work, epochs):
    """Train every model at once, the cores split between them; returns (checkpoint, log) each.

    Small models use two threads poorly, so side by side they finish sooner than one after
    the other, and both see the same machine while their words/s are measured.
    """
    threads = str(max(1, (os.cpu_count() or 2) // len(MODELS)))
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    runs = []  # (arch, save_dir, process or None when already trained)
    progress = []
    for label, arch, extra in MODELS:
        save_dir = os.path.join(work, f"{arch}_e{epochs}")
        process = None
        if not training_finished(save_dir):
            os.makedirs(save_dir, exist_ok=True)
            cmd = [
                os.path.join(BIN, "fairseq-train"),
                bin_dir,
                "--arch",
                arch,
                *extra,
                *MODEL_DIMS,
                *SCHEDULE,
                "--max-epoch",
                str(epochs),
                "--save-dir",
                save_dir,
                *json_log_options(PROGRESS_LOG_INTERVAL),
            ]
            print("$ " + " ".join(cmd), flush=True)
            with open(os.path.join(save_dir, "train.log"), "w") as log:
                process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            progress.append(RunLog(os.path.join(save_dir, "train.log"), label, max_epoch=epochs))
        runs.append((arch, save_dir, process))
    start = time.time()
    wait_with_progress([p for _, _, p in runs], progress, ProgressDisplay())
    results = []
    for arch, save_dir, process in runs:
        log_path = os.path.join(save_dir, "train.log")
        if process is not None and process.wait() != 0:
            sys.exit(
                f"fairseq-train {arch} failed ({process.returncode}), see {log_path}:\n"
                + open(log_path).read()[-3000:]
            )
        results.append((os.path.join(save_dir, "checkpoint_best.pt"), log_path))
    print(f"| trained {len(MODELS)} models side by side in {time.time() - start:.0f} s")
    return results


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


def bleu(bin_dir, checkpoint, extra, out_path):
    if not up_to_date(out_path, checkpoint):
        run(
            [
                os.path.join(BIN, "fairseq-generate"),
                bin_dir,
                *extra,
                "--path",
                checkpoint,
                "--gen-subset",
                "test",
                "--beam",
                "5",
                "--batch-size",
                "128",
                "--max-len-a",
                "1.2",
                "--max-len-b",
                "10",
                "--remove-bpe",
                "sentencepiece",
                "--scoring",
                "sacrebleu",
                "--num-workers",
                "0",
                "--required-batch-size-multiple",
                "1",
            ],
            log_path=out_path,
        )
    match = re.search(r"BLEU = ([\d.]+)", open(out_path).read())
    return float(match.group(1)) if match else float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default=os.path.join(ROOT, "demo_runs"))
    parser.add_argument(
        "--corpus",
        choices=sorted(CORPORA),
        default=DEFAULT_CORPUS,
        help="ding-de-en: short dictionary sentences (default); bible-en-es: Bible verses",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=int(os.environ["DEMO_EPOCHS"]) if os.environ.get("DEMO_EPOCHS") else None,
        help="training epochs per model (env DEMO_EPOCHS; default 16 for ding-de-en, "
        "3 for bible-en-es); more trains longer",
    )
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument(
        "--max-train",
        type=int,
        default=None,
        help="train on this many pairs only (quick smoke runs; use a new --work-dir)",
    )
    parser.add_argument(
        "--test-size",
        type=int,
        default=None,
        help="test sentences (default: the corpus's test split; quick smoke runs)",
    )
    args = parser.parse_args()
    console_logging()
    src, tgt, _, corpus_name, default_epochs = CORPORA[args.corpus]
    epochs = args.epochs or default_epochs
    if epochs < 1 or any(v is not None and v < 1 for v in (args.max_train, args.test_size)):
        parser.error("--epochs, --max-train and --test-size must be at least 1")

    work = corpus_work_dir(os.path.abspath(args.work_dir), args.corpus)
    data_dir = data_dir_for(work, args.vocab_size, args.max_train)
    if args.test_size:
        data_dir = f"{data_dir}_test{args.test_size}"
    started = time.time()
    bin_dir = prepare_data(data_dir, args.vocab_size, args.max_train, args.test_size, args.corpus)
    with open(os.path.join(data_dir, "raw", f"test.{tgt}"), encoding="utf-8") as f:
        test_size = sum(1 for _ in f)

    rows = []
    for (label, arch, extra), (checkpoint, log) in zip(
        MODELS, train_all(bin_dir, work, epochs)
    ):
        generated = os.path.join(os.path.dirname(checkpoint), "generate-test.txt")
        rows.append(
            {
                "model": label,
                "encoder_attention_params": encoder_attention_parameters(checkpoint),
                "bleu": bleu(bin_dir, checkpoint, extra, generated),
                "train_words_per_s": words_per_second(log),
            }
        )

    header = "| model | encoder attention params | BLEU (test) | train words/s |"
    lines = [header, "|---|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['encoder_attention_params'] / 1e6:.3f}M | "
            f"{r['bleu']:.2f} | {r['train_words_per_s']:.0f} |"
        )
    table = "\n".join(lines)
    title = f"{corpus_name} test ({test_size} sentences), {epochs} epochs per model"
    atomic_write_text(os.path.join(work, "results.md"), f"{title}\n\n{table}\n")
    atomic_write_text(
        os.path.join(work, "results.json"),
        json.dumps({"corpus": args.corpus, "epochs": epochs, "rows": rows}, indent=2),
    )
    print(f"\n{title}, {(time.time() - started) / 60:.1f} min\n")
    print(table)


if __name__ == "__main__":
    main()
