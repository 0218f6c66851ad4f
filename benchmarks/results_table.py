#!/usr/bin/env python3
"""The docs' kernel table from the records of ``banded_attention.py --json``.

    python benchmarks/results_table.py benchmarks/results/*.json
    python benchmarks/results_table.py benchmarks/results/h200_bf16_d64_fwd_bwd_grid.json \\
        --output kernel_table.md

One row per (gpu, dtype, B, H, D, mode, T, w) cell: the median ms of the routes present (banded
= the CUDA-core kernels, tensor-core, blocked, flex, sdpa, global; "-" where a route is absent
or has a note), the tensor-core kernel's useful TFLOP/s and HBM GB/s, and flex / tensor-core and
global / tensor-core (above 1: the tensor-core kernel is faster). A file that is not a JSON list
of such records is refused (exit status 2). An existing --output is replaced only when it holds
a table this script wrote, or with --overwrite.
"""

import argparse

from local_attn_fairseq.cli_types import output_file
from local_attn_fairseq.experiments import kernel_results
from local_attn_fairseq.experiments.measurement import (
    add_overwrite_option,
    check_output_file,
    write_output_file,
)
from local_attn_fairseq.file_safety import refuse_same_file


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", metavar="FILE", help="records written by --json")
    parser.add_argument(
        "--output", metavar="FILE.md", type=output_file, help="also write the table to this file"
    )
    add_overwrite_option(parser)
    return parser, parser.parse_args(argv)


def main(argv=None):
    parser, args = parse_args(argv)
    try:
        records = kernel_results.load_files(args.files)
        for path in args.files if args.output else ():
            refuse_same_file(path, args.output)  # the table must not replace its records
    except ValueError as error:  # MalformedRecords included: a message, not a traceback
        parser.error(str(error))
    if args.output:
        check_output_file(args.output, "--output", args.overwrite)
    table = kernel_results.kernel_table(records)
    print(table, end="")
    if args.output:
        write_output_file(args.output, "--output", table)


if __name__ == "__main__":
    main()
