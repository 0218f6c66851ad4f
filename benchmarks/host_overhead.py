#!/usr/bin/env python3
"""Host overhead per call at tiny shapes: each mechanism's attention against its peer.

One forward + backward per call, the two sides of each row alternating in rounds (the machine is
shared and noisy: the ratio of the medians is what counts):

    banded     ops.banded_attention (B=1 H=2 T=16 D=16, window 2+2) vs scaled_dot_product_attention
    local-k    every head local-2 (banded)            vs fairseq's MultiheadAttention (T=8 B=2 C=64,
    pande      tied fixed masks (1loc7tied-all6)         8 heads, taken from fairseq's transformer)
    gaussian   Yang's Gaussian localness
    mw, aw     Nguyen's dynamic windows
    gates      Voita's Hard Concrete head gates (training)
    pruned     a layer pruned to 2 of 8 heads

Targets (ours / peer): banded <= 1.2; local-k, pande, pruned <= 1.1; gaussian, gates <= 1.3;
mw, aw <= 1.6. On the CPU a call's time is the process's CPU time (a shared machine's other
work does not count); on CUDA the host time is the wall time of issuing the calls (no
synchronisation inside the loop) and the GPU time the profiler's kernel time, both per call.

    python benchmarks/host_overhead.py [--rounds 7] [--calls 200] [--threads 1]
    python benchmarks/host_overhead.py --only banded local-k --profile 12
    python benchmarks/host_overhead.py --device cuda --output host_overhead_gpu.md
"""

import argparse
import sys

import torch

from local_attn_fairseq.cli_types import non_negative_int, output_file, positive_int
from local_attn_fairseq.experiments import host_overhead
from local_attn_fairseq.experiments.measurement import (
    add_overwrite_option,
    check_output_file,
    write_output_file,
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="torch CPU threads (default 1: the host's cost)",
    )
    parser.add_argument("--rounds", type=positive_int, default=7, help="alternating rounds per row")
    parser.add_argument("--calls", type=positive_int, default=200, help="calls per side per round")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=host_overhead.ROW_NAMES,
        metavar="NAME",
        help=f"rows to time: {', '.join(host_overhead.ROW_NAMES)} (default: all)",
    )
    parser.add_argument(
        "--padding-mask",
        action="store_true",
        help="pass the modules an all-False key_padding_mask instead of None",
    )
    parser.add_argument(
        "--output", metavar="FILE.md", type=output_file, help="also write the table to this file"
    )
    parser.add_argument(
        "--profile",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="also print torch.profiler's N most expensive operations of each side",
    )
    add_overwrite_option(parser)
    args = parser.parse_args(argv)
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    if args.output:
        check_output_file(args.output, "--output", args.overwrite)
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    names = args.only or host_overhead.ROW_NAMES
    rows, results = host_overhead.run(
        names,
        args.device,
        args.rounds,
        args.calls,
        args.padding_mask,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    settings = host_overhead.settings_line(
        args.device, args.rounds, args.calls, args.padding_mask
    )
    table = host_overhead.report(results, settings, args.device.type == "cuda")
    print("\n" + table)
    if args.output:
        write_output_file(args.output, "--output", table)
    if args.profile:
        print(host_overhead.profiles(rows, args.calls, args.device, args.profile))


if __name__ == "__main__":
    main()
