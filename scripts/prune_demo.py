#!/usr/bin/env python3
"""Pruning encoder heads on the demo data, Voita et al.'s procedure (Section 6.2) end to end.

1. the demo's baseline Transformer (8 heads x 6 encoder layers = 48 heads; trained if missing);
2. for every lambda: fine-tune it with Hard Concrete gates on the encoder heads and the L0
   criterion, the decoder fixed (``--head-gates enc --freeze-decoder``);
3. prune the closed heads out of the checkpoint (``scripts/prune_heads.py``);
4. BLEU of the gated model (test-time gates) and of the pruned model on the test split.

Writes a table of BLEU against the number of encoder heads kept (the shape of the paper's
Figure 7) to ``WORK/pruning/results.md``.

    python scripts/prune_demo.py [--lambdas 0.02,0.05,0.1,0.2] [--finetune-epochs 3]
"""

import argparse
import json
import os
import sys
import time

import demo

from local_attn_fairseq.file_safety import atomic_write_text

ROOT, BIN, USER_DIR = demo.ROOT, demo.BIN, demo.USER_DIR
sys.path.insert(0, ROOT)


def train_baseline(bin_dir, work, epochs):
    save_dir = os.path.join(work, f"transformer_e{epochs}")
    checkpoint = os.path.join(save_dir, "checkpoint_best.pt")
    if not demo.training_finished(save_dir):
        os.makedirs(save_dir, exist_ok=True)
        demo.run(
            [os.path.join(BIN, "fairseq-train"), bin_dir, "--arch", "transformer",
             "--user-dir", USER_DIR, *demo.MODEL_DIMS, *demo.SCHEDULE,
             "--max-epoch", epochs, "--save-dir", save_dir],
            log_path=os.path.join(save_dir, "train.log"),
        )  # fmt: skip
    return checkpoint


def finetune_with_gates(bin_dir, baseline, save_dir, l0_lambda, epochs, log_alpha_init):
    checkpoint = os.path.join(save_dir, "checkpoint_last.pt")
    if not demo.training_finished(save_dir):
        os.makedirs(save_dir, exist_ok=True)
        schedule = [a for a in demo.SCHEDULE if a != "--no-last-checkpoints"]
        demo.run(
            [os.path.join(BIN, "fairseq-train"), bin_dir, "--arch", "transformer_local",
             "--user-dir", USER_DIR, *demo.MODEL_DIMS, *schedule,
             "--finetune-from-model", baseline, "--head-gates", "enc", "--freeze-decoder",
             "--head-gate-log-alpha-init", log_alpha_init,
             "--criterion", "label_smoothed_cross_entropy_l0", "--l0-lambda", l0_lambda,
             "--max-epoch", epochs, "--save-dir", save_dir],
            log_path=os.path.join(save_dir, "train.log"),
        )  # fmt: skip
    return checkpoint


def prune(gated, pruned):
    if not demo.up_to_date(pruned, gated):
        demo.run([sys.executable, os.path.join(ROOT, "scripts", "prune_heads.py"), gated, pruned])
    return pruned


def encoder_heads(checkpoint):
    import torch

    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["model"]
    return sum(
        v.shape[0] // 16
        for k, v in state.items()
        if k.startswith("encoder.layers.") and k.endswith("self_attn.v_proj.weight")
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default=os.path.join(ROOT, "demo_runs"))
    parser.add_argument("--epochs", type=int, default=int(os.environ.get("DEMO_EPOCHS", 16)))
    parser.add_argument("--lambdas", default="0.02,0.05,0.1,0.2")
    parser.add_argument("--finetune-epochs", type=int, default=3)
    parser.add_argument("--log-alpha-init", type=float, default=1.0)
    parser.add_argument("--vocab-size", type=int, default=demo.DEFAULT_VOCAB_SIZE)
    parser.add_argument("--max-train", type=int, default=None)
    args = parser.parse_args()

    started = time.time()
    work = os.path.abspath(args.work_dir)
    bin_dir = demo.prepare_data(
        demo.data_dir_for(work, args.vocab_size, args.max_train), args.vocab_size, args.max_train
    )
    baseline = train_baseline(bin_dir, work, args.epochs)
    out_dir = os.path.join(work, "pruning")
    os.makedirs(out_dir, exist_ok=True)
    plugin = ["--user-dir", USER_DIR]
    rows = [
        {
            "lambda": 0.0,
            "encoder_heads": 48,
            "bleu_gated": None,
            "bleu_pruned": demo.bleu(bin_dir, baseline, plugin, os.path.join(out_dir, "base.txt")),
        }
    ]
    for l0_lambda in [float(x) for x in args.lambdas.split(",")]:
        name = f"lambda{l0_lambda:g}_ft{args.finetune_epochs}"
        gated = finetune_with_gates(
            bin_dir, baseline, os.path.join(out_dir, name), l0_lambda,
            args.finetune_epochs, args.log_alpha_init,
        )  # fmt: skip
        pruned = prune(gated, os.path.join(out_dir, name, "pruned.pt"))
        rows.append(
            {
                "lambda": l0_lambda,
                "encoder_heads": encoder_heads(pruned),
                "bleu_gated": demo.bleu(bin_dir, gated, plugin, os.path.join(out_dir, name, "gated.txt")),
                "bleu_pruned": demo.bleu(bin_dir, pruned, plugin, os.path.join(out_dir, name, "pruned.txt")),
            }
        )  # fmt: skip

    lines = [
        "| lambda | encoder heads kept | BLEU gated (test-time gates) | BLEU pruned |",
        "|---:|---:|---:|---:|",
    ]
    for r in rows:
        gated = "-" if r["bleu_gated"] is None else f"{r['bleu_gated']:.2f}"
        lines.append(
            f"| {r['lambda']:g} | {r['encoder_heads']} / 48 | {gated} | {r['bleu_pruned']:.2f} |"
        )
    table = "\n".join(lines)
    header = (
        f"Ding de-en test (1000 sentences): baseline trained {args.epochs} epochs, then "
        f"{args.finetune_epochs} epochs of fine-tuning with encoder head gates per lambda"
    )
    atomic_write_text(os.path.join(out_dir, "results.md"), f"{header}\n\n{table}\n")
    results = json.dumps({"args": vars(args), "rows": rows}, indent=2)
    atomic_write_text(os.path.join(out_dir, "results.json"), results)
    print(f"\n{header}, {(time.time() - started) / 60:.1f} min\n\n{table}")


if __name__ == "__main__":
    main()
