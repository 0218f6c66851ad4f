#!/usr/bin/env python3
"""The demo: real German-English data, a baseline Transformer and ``transformer_local_tied``.

1. extracts ~18k sentence pairs from Debian's Ding dictionary (``scripts/prepare_ding.py``);
2. trains a joint sentencepiece model and binarises with ``fairseq-preprocess``;
3. trains fairseq's ``transformer`` and the plugin's ``transformer_local_tied`` (Pande et al.
   config (i): every encoder head local, one Wq/Wk per layer) with ``fairseq-train``, same
   sizes and schedule;
4. scores both on the test split with ``fairseq-generate --scoring sacrebleu``;
5. prints one table (model, encoder attention parameters, BLEU, training words/s) and writes it
   to ``<work-dir>/results.md``.

Every step is skipped when its output exists, so a second run only redoes what is missing.
``--epochs`` trains longer (the default fits the whole demo in about 20 minutes on 2 cores).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

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


def data_dir_for(work, vocab_size, max_train=None):
    name = f"data_spm{vocab_size}" + (f"_train{max_train}" if max_train else "")
    path = os.path.join(work, name)
    os.makedirs(path, exist_ok=True)
    return path


def prepare_data(work, vocab_size, max_train=None, test_size=None):
    raw, spm_dir, bin_dir = (os.path.join(work, d) for d in ("raw", "spm", "bin"))
    if not os.path.exists(os.path.join(raw, "test.en")):
        limit = ["--max-train", str(max_train)] if max_train else []
        limit += ["--test-size", str(test_size)] if test_size else []
        run(
            [
                sys.executable,
                os.path.join(ROOT, "scripts", "prepare_ding.py"),
                "--out-dir",
                raw,
                *limit,
            ]
        )
    if not os.path.exists(os.path.join(spm_dir, "test.en")):
        os.makedirs(spm_dir, exist_ok=True)
        model = train_sentencepiece(
            [f"{raw}/train.de", f"{raw}/train.en"], os.path.join(spm_dir, "spm"), vocab_size
        )
        for split in ("train", "valid", "test"):
            for lang in ("de", "en"):
                encode_file(model, f"{raw}/{split}.{lang}", f"{spm_dir}/{split}.{lang}")
        print(f"| sentencepiece: joint vocabulary of {vocab_size} -> {spm_dir}")
    if not os.path.exists(os.path.join(bin_dir, "test.de-en.en.bin")):
        run(
            [
                os.path.join(BIN, "fairseq-preprocess"),
                "--source-lang",
                "de",
                "--target-lang",
                "en",
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
    for _, arch, extra in MODELS:
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
            ]
            print("$ " + " ".join(cmd), flush=True)
            with open(os.path.join(save_dir, "train.log"), "w") as log:
                process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        runs.append((arch, save_dir, process))
    start = time.time()
    results = []
    for arch, save_dir, process in runs:
        log_path = os.path.join(save_dir, "train.log")
        if process is not None and process.wait() != 0:
            sys.exit(
                f"fairseq-train {arch} failed ({process.returncode}), see {log_path}:\n"
                + open(log_path).read()[-3000:]
            )
        results.append((os.path.join(save_dir, "checkpoint_best.pt"), open(log_path).read()))
    print(f"| trained {len(MODELS)} models side by side in {time.time() - start:.0f} s")
    return results


def words_per_second(train_log):
    """Mean of the per-epoch target words/s fairseq reports, leaving out the warm-up epoch."""
    rates = [float(x) for x in re.findall(r"\| train \| epoch \d+ .*?\| wps ([\d.]+)", train_log)]
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
            ],
            log_path=out_path,
        )
    match = re.search(r"BLEU = ([\d.]+)", open(out_path).read())
    return float(match.group(1)) if match else float("nan")


def encoder_attention_parameters(checkpoint):
    """Encoder self-attention weights (no biases) in the checkpoint: each tensor is stored once."""
    import torch

    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["model"]
    return sum(
        v.numel()
        for k, v in state.items()
        if k.startswith("encoder.layers.") and ".self_attn." in k and k.endswith("weight")
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default=os.path.join(ROOT, "demo_runs"))
    parser.add_argument(
        "--epochs",
        type=int,
        default=int(os.environ.get("DEMO_EPOCHS", 16)),
        help="training epochs per model (env DEMO_EPOCHS); more trains longer",
    )
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument(
        "--max-train",
        type=int,
        default=None,
        help="train on this many pairs only (quick smoke runs; use a new --work-dir)",
    )
    args = parser.parse_args()

    work = os.path.abspath(args.work_dir)
    data_dir = data_dir_for(work, args.vocab_size, args.max_train)
    started = time.time()
    bin_dir = prepare_data(data_dir, args.vocab_size, args.max_train)

    rows = []
    for (label, arch, extra), (checkpoint, log) in zip(
        MODELS, train_all(bin_dir, work, args.epochs)
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
    with open(os.path.join(work, "results.md"), "w") as f:
        f.write(f"Ding de-en test (1000 sentences), {args.epochs} epochs per model\n\n{table}\n")
    with open(os.path.join(work, "results.json"), "w") as f:
        json.dump({"epochs": args.epochs, "rows": rows}, f, indent=2)
    print(
        f"\nDing de-en, test split (1000 sentences), {args.epochs} epochs per model, "
        f"{(time.time() - started) / 60:.1f} min\n"
    )
    print(table)


if __name__ == "__main__":
    main()
