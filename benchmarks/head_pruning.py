#!/usr/bin/env python3
"""What pruning encoder heads buys: encoder forward time and checkpoint size, side by side.

Two Transformer-base encoders (512 dims, 8 heads, 6 layers) are built through fairseq's argument
parsing: the full one, and one that keeps only ``--kept`` heads per layer (the shape
``scripts/prune_heads.py`` writes; 2 of 8 heads is 3/4 of the heads pruned, as in Voita et al.'s
sparse WMT model). They run on the same batches in alternating rounds within one process (the
machine is shared and noisy) and the ratios of the median times are printed.

    python benchmarks/head_pruning.py [--kept 2] [--length 128] [--batch 16] [--rounds 7]
"""

import argparse
import io
import os
import statistics
import tempfile
import time

import torch
from fairseq import options, tasks

import local_attn_fairseq  # noqa: F401  (registers the plugin)
from local_attn_fairseq.cli_types import positive_int

BASE = "--arch transformer_local -s de -t en --encoder-layers 6 --encoder-attention-heads 8".split()


def build(data_dir, heads_kept):
    extra = ["--heads-kept", f"{{encoder_self: {heads_kept}}}"] if heads_kept else []
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [data_dir, *BASE, *extra])
    task = tasks.setup_task(args)
    return task.build_model(args).eval()


def dictionaries(path, size):
    for lang in ("de", "en"):
        with open(os.path.join(path, f"dict.{lang}.txt"), "w") as f:
            f.writelines(f"w{i} 1\n" for i in range(size))


def state_bytes(module):
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    return buffer.tell()


def attention_only(model, x, padding):
    for layer in model.encoder.layers:
        layer.self_attn(x, x, x, key_padding_mask=padding, need_weights=False)


def timed(fn, repeats):
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(repeats):
            fn()
    return (time.perf_counter() - start) / repeats


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--kept", type=positive_int, default=2, help="heads kept in every encoder layer (1-8)"
    )
    parser.add_argument(
        "--length", type=positive_int, default=128, help="source tokens per sentence"
    )
    parser.add_argument("--batch", type=positive_int, default=16)
    parser.add_argument("--rounds", type=positive_int, default=7)
    parser.add_argument(
        "--repeats", type=positive_int, default=3, help="forward passes per timing"
    )
    args = parser.parse_args(argv)
    if args.kept > 8:  # the encoders have 8 heads per layer
        parser.error(f"--kept: at most 8 heads per layer, got {args.kept}")
    return args


def main(argv=None):
    args = parse_args(argv)

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as data_dir:
        dictionaries(data_dir, 8000)
        models = {"full (48 heads)": build(data_dir, None)}
        kept = [args.kept] * 6
        models[f"pruned ({sum(kept)} heads)"] = build(data_dir, kept)
    tokens = torch.randint(4, 8000, (args.batch, args.length))
    lengths = torch.full((args.batch,), args.length)
    x = torch.randn(args.length, args.batch, 512)
    padding = torch.zeros(args.batch, args.length, dtype=torch.bool)

    times = {name: {"encoder": [], "attention": []} for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            times[name]["encoder"].append(
                timed(lambda: model.encoder(tokens, src_lengths=lengths), args.repeats)
            )
            times[name]["attention"].append(
                timed(lambda: attention_only(model, x, padding), args.repeats)
            )

    full = next(iter(models))
    print(
        f"encoder forward, batch {args.batch} x {args.length} tokens, {args.rounds} rounds "
        f"(median), {torch.get_num_threads()} threads\n"
    )
    print("| model | encoder ms | attention ms | checkpoint MiB | attention params |")
    print("|---|---:|---:|---:|---:|")
    summary = {}
    for name, model in models.items():
        enc = statistics.median(times[name]["encoder"]) * 1e3
        att = statistics.median(times[name]["attention"]) * 1e3
        size = state_bytes(model) / 2**20
        params = sum(p.numel() for n, p in model.encoder.named_parameters() if ".self_attn." in n)
        summary[name] = (enc, att, size)
        print(f"| {name} | {enc:.1f} | {att:.1f} | {size:.1f} | {params / 1e6:.2f}M |")
    for name in list(models)[1:]:
        enc, att, size = (summary[name][i] / summary[full][i] for i in range(3))
        print(
            f"\nratio {name} / {full}: encoder time {enc:.3f}, attention time {att:.3f}, "
            f"checkpoint size {size:.3f}"
        )


if __name__ == "__main__":
    main()
