"""The docs' kernel tables, made from the records that ``benchmarks/banded_attention.py --json``
writes (the GPU runs' records are committed under ``benchmarks/results/``).

One Markdown table, one row per (gpu, dtype, B, H, D, mode, T, w) cell: the median ms of each
route present in the records, in a fixed order, then the tensor-core kernel's useful band TFLOP/s
and HBM GB/s, and how much longer flex and global attention take than the tensor-core kernel.
The figures are copied from the records, never re-measured, so that every number quoted in the
docs can be traced to the run that gave it. This module only reads JSON: it imports no torch.
"""

import numbers
from typing import Dict, Iterable, List, Sequence, Tuple

from ..file_safety import read_json

# The routes the docs compare, in the order of their columns: the CUDA-core kernels (the
# benchmark's "banded" route), the tensor-core kernel, blocked SDPA, FlexAttention, SDPA with a
# dense band mask, and unmasked global attention. The masked-dense "naive" route is left out:
# it says nothing about the kernels that SDPA's row does not already say.
ROUTES = ("banded", "tensor-core", "blocked", "flex", "sdpa", "global")
# The route whose throughput is shown and against which the others are compared.
REFERENCE = "tensor-core"
RATIO_ROUTES = ("flex", "global")

TEXT, INTEGER, FIGURE, NOTE = "a string", "an integer", "a number or null", "a string or null"
FIELDS = {
    "gpu": TEXT, "torch": TEXT, "date": TEXT, "dtype": TEXT,
    "B": INTEGER, "H": INTEGER, "D": INTEGER, "T": INTEGER, "w": INTEGER,
    "mode": TEXT, "route": TEXT,
    "ms": FIGURE, "band_tflops": FIGURE, "hbm_gbps": FIGURE, "note": NOTE,
}  # fmt: skip
CELL_FIELDS = ("gpu", "dtype", "B", "H", "D", "mode", "T", "w")


class MalformedRecords(ValueError):
    """A file that is not a JSON list of the benchmark's records; the message names the file."""


def _has_kind(value, kind):
    if kind == TEXT:
        return isinstance(value, str)
    if kind == INTEGER:  # bool is an int subclass, and never a size
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == FIGURE:
        return value is None or isinstance(value, numbers.Real) and not isinstance(value, bool)
    return value is None or isinstance(value, str)


def check_records(records, source: str) -> List[dict]:
    """`records` if it is a non-empty list of complete records, else MalformedRecords."""
    if not isinstance(records, list):
        raise MalformedRecords(
            f"{source}: not a list of benchmark records (a JSON {type(records).__name__})"
        )
    if not records:
        raise MalformedRecords(f"{source}: holds no records (an empty list)")
    for index, record in enumerate(records):
        where = f"{source}: record {index}"
        if not isinstance(record, dict):
            raise MalformedRecords(f"{where} is a JSON {type(record).__name__}, not an object")
        missing = [name for name in FIELDS if name not in record]
        if missing:
            raise MalformedRecords(f"{where} lacks {', '.join(map(repr, missing))}")
        for name, kind in FIELDS.items():
            if not _has_kind(record[name], kind):
                raise MalformedRecords(f"{where}: {name!r} must be {kind}, not {record[name]!r}")
        if record["note"] is None and record["ms"] is None:
            raise MalformedRecords(f"{where}: 'ms' is null but no 'note' says why")
    return records


def load_records(path: str) -> List[dict]:
    """The records of one --json file, checked; MalformedRecords names the file and the fault."""
    return check_records(read_json(path, MalformedRecords), path)


def load_files(paths: Iterable[str]) -> List[dict]:
    """All records of `paths`, refusing a route measured twice for one cell: a table must not
    quietly quote one of two runs."""
    seen: Dict[Tuple, str] = {}
    records = []
    for path in paths:
        for index, record in enumerate(load_records(path)):
            key = tuple(record[name] for name in CELL_FIELDS) + (record["route"],)
            where = f"{path}: record {index}"
            if key in seen:
                raise MalformedRecords(
                    f"{where} measures route {record['route']!r} of a cell that {seen[key]} "
                    "already measured; pass one run per cell"
                )
            seen[key] = where
            records.append(record)
    return records


def _ms(value: float) -> str:
    # two decimals as the benchmark's own table prints them, three below 1 ms (global attention
    # and the kernels at short lengths take half a millisecond: two decimals would hide a 2% gap)
    return f"{value:.2f}" if value >= 1 else f"{value:.3f}"


def _values(records: Sequence[dict], name: str) -> str:
    return ", ".join(sorted({r[name] for r in records}))


def header_line(records: Sequence[dict]) -> str:
    """The GPUs, torch versions and days of the records, so that the table names its source."""
    days = sorted({r["date"][:10] for r in records})  # ISO dates: the day is the first 10
    return f"GPU: {_values(records, 'gpu')}; torch {_values(records, 'torch')}; {', '.join(days)}"


def kernel_table(records: Sequence[dict]) -> str:
    """The header line and the Markdown table of `records` (checked by `check_records`)."""
    present = {r["route"] for r in records}
    routes = [route for route in ROUTES if route in present]
    ratios = [route for route in RATIO_ROUTES if route in present and REFERENCE in present]
    several_gpus = len({r["gpu"] for r in records}) > 1  # else the header line names it

    cells: Dict[Tuple, Dict[str, dict]] = {}
    for record in records:
        cell = tuple(record[name] for name in CELL_FIELDS)
        cells.setdefault(cell, {})[record["route"]] = record

    header = (["gpu"] if several_gpus else []) + ["dtype", "B x H x D", "mode", "T", "w"]
    header += [f"{route} ms" for route in routes]
    if REFERENCE in present:
        header += [f"{REFERENCE} TFLOP/s", f"{REFERENCE} GB/s"]
    header += [f"{route} / {REFERENCE}" for route in ratios]

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cell in sorted(cells):
        gpu, dtype, batch, heads, dim, mode, length, width = cell
        by_route = cells[cell]
        # a route with a note did not run (skipped, failed): its figures are not a time
        measured = {
            route: record
            for route, record in by_route.items()
            if record["note"] is None and record["ms"] is not None
        }
        row = ([gpu] if several_gpus else []) + [dtype, f"{batch} x {heads} x {dim}", mode]
        row += [str(length), str(width)]
        row += [_ms(measured[route]["ms"]) if route in measured else "-" for route in routes]
        reference = measured.get(REFERENCE, {})
        if REFERENCE in present:
            tflops, gbps = reference.get("band_tflops"), reference.get("hbm_gbps")
            row.append("-" if tflops is None else f"{tflops:.1f}")
            row.append("-" if gbps is None else f"{gbps:.0f}")
        for route in ratios:
            ok = route in measured and reference.get("ms", 0) > 0
            row.append(f"{measured[route]['ms'] / reference['ms']:.2f}" if ok else "-")
        lines.append("| " + " | ".join(row) + " |")
    return header_line(records) + "\n\n" + "\n".join(lines) + "\n"
