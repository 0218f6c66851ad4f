"""Writing files without destroying a user's data: atomic replacement and owned output folders.

Every script and tool of the project writes through these helpers, so that an interrupted write
never leaves a truncated file under the final name, an output never replaces its own input, and
no folder that the project did not create is emptied or written into without ``--overwrite``.
"""

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

# A folder created by one of the project's tools holds this file, naming the tool.
OWNER_MARKER = ".local_attn_fairseq_output"


@contextlib.contextmanager
def atomic_output(path: str) -> Iterator[str]:
    """Yield a temporary path beside `path`; on success it replaces `path` in one rename.

    The temporary file lives in the same folder (``os.replace`` is atomic only within one file
    system) and is removed if the body raises, so `path` is either the old file or the new one.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    os.close(handle)
    try:
        yield temporary
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def atomic_write_text(path: str, text: str) -> None:
    with atomic_output(path) as temporary:
        with open(temporary, "w", encoding="utf-8") as out:
            out.write(text)


def refuse_same_file(input_path: str, output_path: str) -> None:
    """Raise if `output_path` names the same file as `input_path` (directly or via a link)."""
    same = os.path.realpath(input_path) == os.path.realpath(output_path)
    if not same and os.path.exists(output_path) and os.path.exists(input_path):
        same = os.path.samefile(input_path, output_path)
    if same:
        raise ValueError(
            f"the output {output_path!r} is the input file; write to a different path"
        )


def claim_output_dir(folder: str, tool: str, overwrite: bool = False) -> None:
    """Make `folder` an output folder of `tool`, refusing one that holds someone else's files.

    An absent or empty folder is created and marked; a folder marked by the same tool is reused;
    anything else is refused unless `overwrite` is set (then it is marked and written into, and
    still nothing in it is deleted).
    """
    marker = os.path.join(folder, OWNER_MARKER)
    if os.path.isdir(folder) and os.listdir(folder):
        owner = None
        if os.path.isfile(marker):
            with open(marker, encoding="utf-8") as handle:
                owner = handle.read().strip()
        if owner != tool and not overwrite:
            described = f"created by {owner}" if owner else "not created by " + tool
            raise FileExistsError(
                f"{folder!r} is not empty and was {described}; choose an empty or new folder, "
                f"or pass --overwrite to write into it (nothing in it is deleted)"
            )
    os.makedirs(folder, exist_ok=True)
    atomic_write_text(marker, tool + "\n")


def replace_own_dir(folder: str, tool: str) -> None:
    """Empty `folder` for a new run of `tool`: it is removed only when absent, empty or marked
    by `tool` (so everything in it was written by `tool`), then created and marked again.

    Raises FileExistsError, deleting nothing, for a non-empty folder of anyone else.
    """
    claim_output_dir(folder, tool)
    shutil.rmtree(folder)
    claim_output_dir(folder, tool)
