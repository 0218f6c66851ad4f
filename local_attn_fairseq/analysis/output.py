"""Where the subcommands' results go: JSON files, PNG figures and a printed table.

One run of a subcommand writes a *set* of files (``bias.json`` and its two figures, ...). Within
:func:`staged_results` (every subcommand of the command line runs in it) they are written into a
hidden staging folder inside ``--output-dir`` and moved into place only when the run succeeds,
the JSON (the record naming the checkpoint and settings) last; see :func:`commit_results` for
what a kill at any moment leaves.
"""

import contextlib
import json
import logging
import math
import os
import secrets
import shutil
from typing import Dict, Iterator, List, Optional, Sequence

from ..file_safety import (
    OWNER_MARKER,
    atomic_output,
    atomic_write_text,
    claim_output_dir,
    folder_owner,
)

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
    """Where a result file `name` is written: inside the staging folder of the run in progress
    in `output_dir` (:func:`staged_results`), else directly in `output_dir`."""
    # The folder is the tool's by now (claim_output_folder), or absent or empty: claimed here.
    claim_output_dir(output_dir, OUTPUT_OWNER)
    staging = _STAGING.get(os.path.abspath(output_dir))
    if staging is None:
        return os.path.join(output_dir, name)
    os.makedirs(staging.folder, exist_ok=True)
    staging.names.add(name)
    return os.path.join(staging.folder, name)


# -- a run's files: all of them or none --------------------------------------------------------
# Hidden names in --output-dir, one subcommand each: the staging folder of a run in progress
# (random suffix) and the list of the files its last completed run wrote.
STAGING_PREFIX = ".local-attn-analyze-staging."
MANIFEST_PREFIX = ".local-attn-analyze-files."
# The record of a run: the file naming its checkpoint and settings. Moved into place last.
RECORD_SUFFIX = ".json"


class _Staging:
    def __init__(self, folder: str):
        self.folder = folder
        self.names: set = set()


# absolute --output-dir -> the staging folder of the run in progress there
_STAGING: Dict[str, _Staging] = {}


def staging_prefix(subcommand: str) -> str:
    return f"{STAGING_PREFIX}{subcommand}."


def manifest_path(output_dir: str, subcommand: str) -> str:
    return os.path.join(output_dir, MANIFEST_PREFIX + subcommand)


def remove_leftover_staging(output_dir: str, subcommand: str) -> List[str]:
    """Delete the staging folders that killed runs of `subcommand` left in `output_dir`.

    Only this subcommand's: another subcommand may be running into the same folder right now,
    while a second run of the same subcommand there would write the same files anyway."""
    removed = []
    prefix = staging_prefix(subcommand)
    for entry in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        path = os.path.join(output_dir, entry)
        if entry.startswith(prefix) and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def read_manifest(output_dir: str, subcommand: str) -> List[str]:
    """The files that runs of `subcommand` wrote in `output_dir` and may still be there."""
    path = manifest_path(output_dir, subcommand)
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as lines:
        # plain names only: a hand-edited line must never reach outside the folder
        names = [line.strip() for line in lines]
    return [n for n in names if n and n == os.path.basename(n) and n not in (".", "..")]


def _write_manifest(output_dir: str, subcommand: str, names) -> None:
    text = "".join(f"{name}\n" for name in sorted(set(names)))
    atomic_write_text(manifest_path(output_dir, subcommand), text)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _move(source: str, destination: str) -> None:
    os.replace(source, destination)  # one rename: the file is there whole or not at all


def commit_results(output_dir: str, subcommand: str, staging_folder: str) -> None:
    """Move a run's files from `staging_folder` into `output_dir`, replacing the files of the
    previous run of `subcommand` there, so that a JSON record is never beside figures of
    another run:

    1. the manifest lists the old run's files and the new ones (so a kill from here on leaves
       nothing the next run does not know to clean up);
    2. the old JSON records are removed;
    3. the old run's files that this run does not write are removed (only files the manifest
       names, i.e. files this subcommand wrote; never a user's);
    4. the new files other than the JSON are moved in (one rename each);
    5. the new JSON is moved in, last: from this rename on, the new set is complete;
    6. the manifest is rewritten with the new files and the staging folder removed.

    A kill before 2 leaves the old set whole; after 5 the new set whole; in between there is
    no JSON of this subcommand, only figures of either run, which the next run replaces or
    removes.
    """
    new = sorted(os.listdir(staging_folder))
    old = read_manifest(output_dir, subcommand)
    _write_manifest(output_dir, subcommand, old + new)
    records = [n for n in new if n.endswith(RECORD_SUFFIX)]
    for name in sorted(set(old + records)):
        if name.endswith(RECORD_SUFFIX):
            _remove(os.path.join(output_dir, name))
    for name in old:
        if name not in new and name != OWNER_MARKER:
            _remove(os.path.join(output_dir, name))
    for name in [n for n in new if n not in records] + records:
        _move(os.path.join(staging_folder, name), os.path.join(output_dir, name))
    _write_manifest(output_dir, subcommand, new)
    shutil.rmtree(staging_folder, ignore_errors=True)


@contextlib.contextmanager
def staged_results(output_dir: str, subcommand: str) -> Iterator[None]:
    """Within the block, the files written through :func:`output_path` (``write_json``,
    ``save_figure``) go into a fresh hidden staging folder in `output_dir`; they are moved into
    place (:func:`commit_results`) only if the block ends without an exception. A failed run
    leaves the previous results untouched and, if it created `output_dir`, no folder at all.

    The staging folders of earlier runs of `subcommand` that were killed are removed first.
    """
    key = os.path.abspath(output_dir)
    if key in _STAGING:
        raise RuntimeError(f"a run is already writing into {output_dir}")
    existed = os.path.isdir(output_dir)
    if existed and folder_owner(output_dir) == OUTPUT_OWNER:
        remove_leftover_staging(output_dir, subcommand)
    staging = _Staging(os.path.join(output_dir, staging_prefix(subcommand) + secrets.token_hex(4)))
    _STAGING[key] = staging
    try:
        yield
    except BaseException:
        shutil.rmtree(staging.folder, ignore_errors=True)
        if not existed and os.path.isdir(output_dir):
            # created for this run, which wrote nothing in the end: leave no folder behind
            if sorted(os.listdir(output_dir)) == [OWNER_MARKER]:
                shutil.rmtree(output_dir, ignore_errors=True)
        raise
    finally:
        del _STAGING[key]
    if os.path.isdir(staging.folder):
        commit_results(output_dir, subcommand, staging.folder)


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
