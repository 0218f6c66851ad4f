#!/usr/bin/env python3
"""Long contexts on the CPU: fairseq's transformer_lm against transformer_lm_local, training and
decoding.

Three language models of the same sizes (6 layers, 512 dims, 8 heads by default): global
(fairseq's ``transformer_lm``), local (``transformer_lm_local``, every head ``local-64``) and
mixed (every layer 2 global heads and 6 ``local-64``).

    python benchmarks/long_context.py                  # T 1024 to 65536, t 512 to 65536
    python benchmarks/long_context.py --quick          # tiny sizes, seconds
    python benchmarks/long_context.py --lengths 2048 8192 --window 128 --threads 2
    python benchmarks/long_context.py --from-record benchmarks/results/long_context_cpu.json \
        --plot docs/images/long_context_cpu.png   # the tables and the figure of a record

Training: words/s of forward + backward + Adam on one sequence of T tokens (median of --rounds
rounds, the models alternating) and the peak of torch's allocations from building a model
through two training steps; a model whose estimated memory exceeds --memory-cap-gb, or that
runs out of memory, is reported as not fitting, one whose steps are estimated to take longer
than --time-cap-minutes as too slow. Decoding: ms per token at each --decode-lengths t (median
of the --timing-steps steps ending at t) through fairseq's incremental state, and the bytes
each layer's cache holds, for global, local with its rolling window cache and local with
LOCAL_ATTN_FULL_DECODER_CACHE=1, whose logits are compared step by step; then the rolling
cache alone on to each --rolling-decode-lengths t, timed beside a fresh one at the first
decode length. The method in detail: ``local_attn_fairseq/experiments/long_context/``.

The run starts itself again under tcmalloc (--allocator; scripts/setup_env.sh installs it):
glibc's malloc gives every freed activation over 32 MiB back to the kernel and faults it in
again at every step, which makes time per token grow with T for reasons that are not the
model's (local_attn_fairseq/cpu_allocator.py). The record names the malloc it ran under.

Prints the tables with their ratios and writes the record (JSON) to --output, rewritten after
every training length so that a run cut short keeps what it measured; --plot draws time per
token and peak memory against T (PNG).
"""

import argparse
import json
import os
import sys

import torch

from local_attn_fairseq.cli_types import output_file, positive_int
from local_attn_fairseq.cpu_allocator import loaded_allocator, restart_under_tcmalloc
from local_attn_fairseq.experiments import long_context
from local_attn_fairseq.experiments.long_context import plot
from local_attn_fairseq.experiments.long_context.report import NotARecord, read_record
from local_attn_fairseq.experiments.measurement import (
    add_overwrite_option,
    check_output_file,
    write_output_file,
)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def positive_number(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:  # also false for NaN
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def parse_args(argv=None):
    full, quick = long_context.FULL_SIZES, long_context.QUICK_SIZES
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes: T " + " ".join(map(str, quick["lengths"])) + f", {quick['layers']} "
        f"layers, {quick['dims']} dims, window {quick['window']}, decoding to "
        f"{max(quick['rolling_decode_lengths'])} (options given override them)",
    )
    sizes = parser.add_argument_group("sizes (defaults: the full run's; --quick: smaller)")
    for name, kind, text in (
        ("lengths", positive_int, "training sequence lengths T"),
        ("decode-lengths", positive_int, "decoding lengths t at which time and cache are read"),
        ("rolling-decode-lengths", positive_int,
         "longer decoding lengths t, the rolling cache alone"),
    ):
        default = full[name.replace("-", "_")]
        sizes.add_argument(f"--{name}", type=kind, nargs="+", help=f"{text} (default {default})")
    for name, text in (
        ("layers", "decoder layers"),
        ("dims", "embedding dims (FFN: 4 x dims)"),
        ("heads", "attention heads per layer"),
        ("global-heads", "global heads of each mixed layer, the rest local"),
        ("window", "keys behind the query of a local head (local-W)"),
        ("vocab-size", "words in the dictionary (the output layer, the same in every model)"),
        ("rounds", "alternating training rounds"),
        ("timing-steps", "decoding steps timed up to each decode length"),
    ):
        key = name.replace("-", "_")
        sizes.add_argument(f"--{name}", type=positive_int, help=f"{text} (default {full[key]})")
    parser.add_argument(
        "--memory-cap-gb",
        type=positive_number,
        help="GiB a training configuration may need (estimated before it runs), default "
        f"{full['memory_cap_gb']:g}",
    )
    parser.add_argument(
        "--time-cap-minutes",
        type=positive_number,
        help="minutes one model's training steps at one T may take (estimated from its shorter "
        f"lengths), default {full['time_cap_minutes']:g}",
    )
    parser.add_argument(
        "--threads", type=positive_int, help="torch intra-op threads (default: torch's)"
    )
    parser.add_argument(
        "--allocator",
        choices=("tcmalloc", "system"),
        default="tcmalloc",
        help="malloc of the run: tcmalloc (default; the script starts itself again with it "
        "preloaded, or says why it cannot and runs on the system's) or the one the process "
        "has. glibc's returns every large activation to the kernel and faults it in again at "
        "every step, which makes time per token grow with T",
    )
    parser.add_argument(
        "--output",
        type=output_file,
        metavar="FILE.json",
        help="the record (default: benchmarks/results/long_context_cpu.json, with --quick "
        "long_context_cpu_quick.json)",
    )
    parser.add_argument(
        "--plot",
        type=output_file,
        metavar="FILE.png",
        help="also draw training time per token and peak memory against T",
    )
    parser.add_argument(
        "--from-record",
        metavar="FILE.json",
        help="measure nothing: print the tables of this record (with --plot, draw it too)",
    )
    add_overwrite_option(parser)
    args = parser.parse_args(argv)
    if args.plot:
        check_output_file(args.plot, "--plot", args.overwrite)
    if args.from_record:
        given = [key for key in (*full, "quick", "threads", "output") if getattr(args, key, None)]
        if given:
            options = ", ".join("--" + key.replace("_", "-") for key in given)
            parser.error(f"--from-record measures nothing; it takes --plot, not {options}")
        return args, None
    preset = quick if args.quick else full
    values = {key: getattr(args, key, None) for key in preset}
    values = {key: preset[key] if value is None else value for key, value in values.items()}
    values["lengths"] = tuple(sorted(set(values["lengths"])))
    for key in ("decode_lengths", "rolling_decode_lengths"):
        values[key] = tuple(sorted(set(values[key])))
    settings = long_context.Settings(**values)
    if not settings.global_heads < settings.heads:
        parser.error("--global-heads: must be fewer than --heads (mixed layers need local heads)")
    if settings.dims % settings.heads:
        parser.error(f"--dims {settings.dims} is not a multiple of --heads {settings.heads}")
    if settings.decode_lengths[0] < settings.timing_steps:
        parser.error(
            f"--decode-lengths: {settings.decode_lengths[0]} is shorter than --timing-steps "
            f"{settings.timing_steps}, the steps timed up to it"
        )
    if settings.rolling_decode_lengths[0] <= settings.decode_lengths[-1]:
        parser.error(
            f"--rolling-decode-lengths: {settings.rolling_decode_lengths[0]} is not longer than "
            f"the longest --decode-lengths {settings.decode_lengths[-1]}"
        )
    if args.output is None:
        name = "long_context_cpu_quick.json" if args.quick else "long_context_cpu.json"
        args.output = os.path.join(RESULTS, name)
    check_output_file(args.output, "--output", args.overwrite)
    return args, settings


def main(argv=None):
    args, settings = parse_args(argv)
    if settings is None:
        try:
            record = read_record(args.from_record)
        except NotARecord as error:
            sys.exit(f"--from-record: {error}")
        print(long_context.report(record))
        if args.plot:
            print(f"figure: {plot.draw(record, args.plot)}")
        return
    if args.allocator == "tcmalloc":
        why_not = restart_under_tcmalloc()  # returns only where it does not start again
        if why_not:
            print(f"| long_context | --allocator tcmalloc: {why_not}; measuring under "
                  f"{loaded_allocator()}'s malloc, as the record says", file=sys.stderr)  # fmt: skip
    if args.threads:
        torch.set_num_threads(args.threads)
    record = long_context.run(
        settings,
        progress=lambda line: print(f"| long_context | {line}", file=sys.stderr, flush=True),
        save=lambda record: write_output_file(
            args.output, "--output", json.dumps(record, indent=1) + "\n"
        ),
    )
    print("\n" + long_context.report(record))
    print(f"record: {args.output}")
    if args.plot:
        print(f"figure: {plot.draw(record, args.plot)}")


if __name__ == "__main__":
    main()
