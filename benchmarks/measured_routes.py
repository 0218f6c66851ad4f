#!/usr/bin/env python3
"""Write local_attn_fairseq/ops/measured_routes.py, the cells where ``auto`` follows a committed
GPU record, from the records under benchmarks/results/ (run it after committing new ones).

    python benchmarks/measured_routes.py            # write the module
    python benchmarks/measured_routes.py --check    # exit 1 when it differs from the records
    python benchmarks/measured_routes.py --show FILE...   # the cells these records decide
"""

import argparse
import os
import sys

from local_attn_fairseq.file_safety import atomic_write_text
from local_attn_fairseq.ops.route_records import (
    MODULE_PATH,
    describe_cells,
    measured_routes_text,
)

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="compare with the module instead of writing it"
    )
    parser.add_argument(
        "--show", nargs="+", metavar="FILE",
        help="print the verdict of each cell of these record files (--json of "
        "banded_attention.py) instead of writing the module",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.show:
        missing = [path for path in args.show if not os.path.isfile(path)]
        if missing:
            parser.error(f"--show: no such file: {', '.join(missing)}")
        lines = describe_cells(args.show)
        print("\n".join(lines) if lines else "no cell measured beside FlexAttention and SDPA")
        return
    text = measured_routes_text(REPOSITORY)
    path = os.path.join(REPOSITORY, MODULE_PATH)
    if args.check:
        with open(path) as f:
            same = f.read() == text
        print(f"{MODULE_PATH}: {'matches' if same else 'differs from'} the committed records")
        sys.exit(0 if same else 1)
    atomic_write_text(path, text)
    print(f"wrote {MODULE_PATH}")


if __name__ == "__main__":
    main()
