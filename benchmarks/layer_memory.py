#!/usr/bin/env python3
"""Training memory of one attention layer per mechanism on the CPU operators.

    python benchmarks/layer_memory.py [--lengths 512 2048] [--embed-dim 128] [--heads 4]

One encoder self-attention layer (``LocalMultiheadAttention``, batch --batch, float32, no
dropout), every head alike: MW, AW, Gaussian localness, and Gaussian localness with an AW window
over segments of 5. Per layer and length: the peak of torch's CPU allocations over one forward
+ backward, the bytes autograd saved for the backward, and what the forward left allocated
beyond those and the output (local_attn_fairseq/experiments/layer_memory.py). Memory does not
depend on the machine's load: one run per cell.
"""

import argparse

from local_attn_fairseq.cli_types import output_file, positive_int
from local_attn_fairseq.experiments import layer_memory
from local_attn_fairseq.experiments.measurement import (
    add_overwrite_option,
    check_output_file,
    write_output_file,
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=positive_int, nargs="+", default=[512, 2048])
    parser.add_argument("--embed-dim", type=positive_int, default=128)
    parser.add_argument("--heads", type=positive_int, default=4)
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument(
        "--only",
        nargs="+",
        choices=sorted(layer_memory.LAYERS),
        metavar="LAYER",
        help=f"layers to measure: {', '.join(layer_memory.LAYERS)} (default: all)",
    )
    parser.add_argument(
        "--output", metavar="FILE.md", type=output_file, help="also write the table to this file"
    )
    add_overwrite_option(parser)
    args = parser.parse_args(argv)
    if args.output:
        check_output_file(args.output, "--output", args.overwrite)
    if args.embed_dim % args.heads:
        parser.error("--embed-dim must be a multiple of --heads")
    return args


def main(argv=None):
    args = parse_args(argv)
    table = layer_memory.memory_table(
        args.only or list(layer_memory.LAYERS), args.lengths, args.embed_dim, args.heads,
        args.batch,
    )  # fmt: skip
    print(table)
    if args.output:
        write_output_file(args.output, "--output", table + "\n")


if __name__ == "__main__":
    main()
