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

# Shared by both models: the paper's 8 heads and 6 encoder layers at a size a CPU trains fast.
MODEL_DIMS = [
    "--encoder-embed-dim", "256", "--encoder-ffn-embed-dim", "512",
    "--encoder-layers", "6", "--encoder-attention-heads", "8",
    "--decoder-embed-dim", "256", "--decoder-ffn-embed-dim", "512",
    "--decoder-layers", "3", "--decoder-attention-heads", "8",
    "--encoder-normalize-before", "--decoder-normalize-before", "--share-all-embeddings",
]
SCHEDULE = [
    "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "2e-3",
    "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "300",
    "--dropout", "0.1", "--weight-decay", "0.0001",
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--max-tokens", "2048", "--num-workers", "0", "--seed", "1",
    "--no-epoch-checkpoints", "--no-last-checkpoints", "--log-format", "simple",
    "--log-interval", "100",
]
MODELS = [
    ("transformer (baseline)", "transformer", []),
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


def prepare_data(work, vocab_size):
    raw, spm_dir, bin_dir = (os.path.join(work, d) for d in ("raw", "spm", "bin"))
    if not os.path.exists(os.path.join(raw, "test.en")):
        run([sys.executable, os.path.join(ROOT, "scripts", "prepare_ding.py"), "--out-dir", raw])
    if not os.path.exists(os.path.join(spm_dir, "test.en")):
        import sentencepiece as spm

        os.makedirs(spm_dir, exist_ok=True)
        prefix = os.path.join(spm_dir, "spm")
        spm.SentencePieceTrainer.train(
            input=f"{raw}/train.de,{raw}/train.en", model_prefix=prefix, vocab_size=vocab_size,
            character_coverage=1.0, model_type="unigram", bos_id=-1, eos_id=-1, pad_id=-1,
            unk_id=0, minloglevel=2,
        )
        sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
        for split in ("train", "valid", "test"):
            for lang in ("de", "en"):
                with open(f"{raw}/{split}.{lang}", encoding="utf-8") as src, open(
                    f"{spm_dir}/{split}.{lang}", "w", encoding="utf-8"
                ) as out:
                    for line in src:
                        out.write(" ".join(sp.encode(line.strip(), out_type=str)) + "\n")
        print(f"| sentencepiece: joint vocabulary of {vocab_size} -> {spm_dir}")
    if not os.path.exists(os.path.join(bin_dir, "test.de-en.en.bin")):
        run([os.path.join(BIN, "fairseq-preprocess"), "--source-lang", "de", "--target-lang", "en",
             "--trainpref", f"{spm_dir}/train", "--validpref", f"{spm_dir}/valid",
             "--testpref", f"{spm_dir}/test", "--destdir", bin_dir, "--joined-dictionary",
             "--workers", "2"], log_path=os.path.join(work, "preprocess.log"))
    return bin_dir


def train(bin_dir, save_dir, arch, extra, epochs):
    log_path = os.path.join(save_dir, "train.log")
    checkpoint = os.path.join(save_dir, "checkpoint_best.pt")
    if not os.path.exists(checkpoint):
        os.makedirs(save_dir, exist_ok=True)
        start = time.time()
        run([os.path.join(BIN, "fairseq-train"), bin_dir, "--arch", arch, *extra, *MODEL_DIMS,
             *SCHEDULE, "--max-epoch", epochs, "--save-dir", save_dir], log_path=log_path)
        print(f"| trained {arch} in {time.time() - start:.0f} s")
    return checkpoint, open(log_path).read()


def words_per_second(train_log):
    """Mean of the per-epoch target words/s fairseq reports, leaving out the warm-up epoch."""
    rates = [float(x) for x in re.findall(r"\| train \| epoch \d+ .*?\| wps ([\d.]+)", train_log)]
    if not rates:
        return float("nan")
    return statistics.mean(rates[1:] if len(rates) > 1 else rates)


def bleu(bin_dir, checkpoint, extra, out_path):
    if not os.path.exists(out_path):
        run([os.path.join(BIN, "fairseq-generate"), bin_dir, *extra, "--path", checkpoint,
             "--gen-subset", "test", "--beam", "5", "--batch-size", "128",
             "--remove-bpe", "sentencepiece", "--scoring", "sacrebleu", "--num-workers", "0"],
            log_path=out_path)
    match = re.search(r"BLEU = ([\d.]+)", open(out_path).read())
    return float(match.group(1)) if match else float("nan")


def encoder_attention_parameters(checkpoint):
    """Encoder self-attention weights (no biases) in the checkpoint: each tensor is stored once."""
    import torch

    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["model"]
    return sum(
        v.numel() for k, v in state.items()
        if k.startswith("encoder.layers.") and ".self_attn." in k and k.endswith("weight")
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default=os.path.join(ROOT, "demo_runs"))
    parser.add_argument("--epochs", type=int, default=int(os.environ.get("DEMO_EPOCHS", 12)),
                        help="training epochs per model (env DEMO_EPOCHS); more trains longer")
    parser.add_argument("--vocab-size", type=int, default=8000)
    args = parser.parse_args()

    work = os.path.abspath(args.work_dir)
    data_dir = os.path.join(work, "data")
    os.makedirs(data_dir, exist_ok=True)
    started = time.time()
    bin_dir = prepare_data(data_dir, args.vocab_size)

    rows = []
    for label, arch, extra in MODELS:
        save_dir = os.path.join(work, f"{arch}_e{args.epochs}")
        checkpoint, log = train(bin_dir, save_dir, arch, extra, args.epochs)
        score = bleu(bin_dir, checkpoint, extra, os.path.join(save_dir, "generate-test.txt"))
        rows.append({
            "model": label,
            "encoder_attention_params": encoder_attention_parameters(checkpoint),
            "bleu": score,
            "train_words_per_s": words_per_second(log),
        })

    header = "| model | encoder attention params | BLEU (test) | train words/s |"
    lines = [header, "|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['encoder_attention_params'] / 1e6:.3f}M | "
                     f"{r['bleu']:.2f} | {r['train_words_per_s']:.0f} |")
    table = "\n".join(lines)
    with open(os.path.join(work, "results.md"), "w") as f:
        f.write(f"Ding de-en test (1000 sentences), {args.epochs} epochs per model\n\n{table}\n")
    with open(os.path.join(work, "results.json"), "w") as f:
        json.dump({"epochs": args.epochs, "rows": rows}, f, indent=2)
    print(f"\nDing de-en, test split (1000 sentences), {args.epochs} epochs per model, "
          f"{(time.time() - started) / 60:.1f} min\n")
    print(table)


if __name__ == "__main__":
    main()
