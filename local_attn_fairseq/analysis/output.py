"""Where the subcommands' results go: JSON files, PNG figures and a printed table."""

import json
import logging
import math
import os
from typing import Optional, Sequence

from ..file_safety import atomic_output, atomic_write_text, claim_output_dir

# The owner named in the marker of an output folder (file_safety): one for every subcommand,
# so that the results of several analyses can share a folder.
OUTPUT_OWNER = "local-attn-analyze"

# Pande et al.'s colours: local blue, syntactic orange, unrelated green.
SET_COLOURS = {
    "local": "tab:blue",
    "syntactic": "tab:orange",
    "unrelated": "tab:green",
    "nonlocal": "tab:gray",
}


def claim_output_folder(output_dir: str, overwrite: bool = False) -> None:
    """Refuse, before any work, a non-empty folder that the tool did not create (unless
    `overwrite`); an absent or empty one is created only when the first result is written, so
    a run that fails on its input leaves nothing behind."""
    if os.path.isdir(output_dir) and os.listdir(output_dir):
        try:
            claim_output_dir(output_dir, OUTPUT_OWNER, overwrite)
        except FileExistsError as error:
            raise FileExistsError(f"--output-dir {error}") from None


def output_path(output_dir: str, name: str) -> str:
    # The folder is the tool's by now (claim_output_folder), or absent or empty: claimed here.
    claim_output_dir(output_dir, OUTPUT_OWNER)
    return os.path.join(output_dir, name)


def write_json(output_dir: str, name: str, data) -> str:
    path = output_path(output_dir, name)
    atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    return path


def pyplot():
    """matplotlib's pyplot on a file-only backend (no display needed)."""
    # fairseq's speech tasks set the root logger to DEBUG when imported: keep matplotlib quiet
    for name in ("matplotlib", "PIL"):
        logging.getLogger(name).setLevel(logging.WARNING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, output_dir: str, name: str) -> str:
    path = output_path(output_dir, name)
    with atomic_output(path) as temporary:
        # the temporary name has no image suffix: say the format
        image_format = os.path.splitext(name)[1][1:]
        figure.savefig(temporary, dpi=100, bbox_inches="tight", format=image_format)
    pyplot().close(figure)
    return path


def format_number(value: Optional[float], digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}g}" if abs(value) < 1e-2 and value != 0 else f"{value:.{digits}f}"


def format_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    cells = [[str(h) for h in headers]] + [
        [c if isinstance(c, (str, int)) else format_number(c) for c in row] for row in rows
    ]
    cells = [[str(c) for c in row] for row in cells]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def mean(values: Sequence[float]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def median(values: Sequence[float]) -> Optional[float]:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2
