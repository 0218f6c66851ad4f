"""Writing files without destroying a user's data: atomic replacement and owned output folders.

Every script and tool of the project writes through these helpers, so that an interrupted write
never leaves a truncated file under the final name, an output never replaces its own input, and
no folder that the project did not create is emptied or written into without ``--overwrite``.
"""

import contextlib
import fnmatch
import json
import os
import re
import secrets
import shutil
import sys
from typing import Iterator, List, Type

# A folder created by one of the project's tools holds this file, naming the tool.
OWNER_MARKER = ".local_attn_fairseq_output"


class FolderNotOwned(FileExistsError):
    """An output folder holds files that the tool claiming it did not write."""


# The name of a temporary file of `atomic_output`: hidden, the final name, 8 hex digits.
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.[0-9a-f]{8}\.tmp$")


def _create_temporary(folder: str, name: str) -> str:
    """Create an empty hidden file beside `name` in `folder` and return its path.

    Not ``tempfile.mkstemp``: it creates files with mode 0600, and the rename would hand that
    mode to the final file, so a group sharing the folder could not read it. Created with 0666,
    the kernel applies the user's umask (and a default ACL) as for any new file.
    """
    for _ in range(100):
        temporary = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.tmp")
        try:
            handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        os.close(handle)
        return temporary
    raise FileExistsError(f"no free temporary name for {name!r} in {folder!r}")


@contextlib.contextmanager
def atomic_output(path: str) -> Iterator[str]:
    """Yield a temporary path beside `path`; on success it replaces `path` in one rename.

    The temporary file lives in the same folder (``os.replace`` is atomic only within one file
    system) and is removed if the body raises, so `path` is either the old file or the new one.
    The new file has the mode the user's umask gives any new file (0666 & ~umask).
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    temporary = _create_temporary(folder, os.path.basename(path))
    try:
        yield temporary
        publish(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def publish(written: str, path: str) -> None:
    """Rename the whole file `written` to `path`, its data on disk first: after a crash the
    name holds the old file or the complete new one, never a file whose blocks never landed."""
    with open(written, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(written, path)


def remove_leftover_temporaries(folder: str, final_names: str = "*") -> List[str]:
    """Delete the temporary files that `atomic_output` left in `folder` when a run was killed
    mid-write (only those whose final name matches the glob `final_names`); returns their paths.

    Call it where a run starts again in a folder it owns: nothing else writes these names, and
    a run in progress in the same folder would be a second writer of the same files anyway.
    """
    removed = []
    for entry in os.listdir(folder) if os.path.isdir(folder) else []:
        match = _TEMPORARY.match(entry)
        path = os.path.join(folder, entry)
        if match and fnmatch.fnmatchcase(match["name"], final_names) and os.path.isfile(path):
            with contextlib.suppress(FileNotFoundError):  # another rank of the run was first
                os.remove(path)
                removed.append(path)
    return removed


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


def folder_owner(folder: str):
    """The tool named in `folder`'s marker, or None."""
    marker = os.path.join(folder, OWNER_MARKER)
    if not os.path.isfile(marker):
        return None
    with open(marker, encoding="utf-8", errors="replace") as handle:
        return handle.read().strip()


def check_output_dir(folder: str, tool: str, overwrite: bool = False) -> None:
    """Raise FolderNotOwned if `claim_output_dir` would refuse `folder`; changes nothing.

    Lets a tool refuse a folder before its work (reading a corpus) and claim it only when it has
    something to write, so that a refused run leaves no folder behind.
    """
    if os.path.isdir(folder) and os.listdir(folder):
        owner = folder_owner(folder)
        if owner != tool and not overwrite:
            described = f"created by {owner}" if owner else "not created by " + tool
            raise FolderNotOwned(
                f"{folder!r} is not empty and was {described}; choose an empty or new folder, "
                f"or pass --overwrite to write into it (nothing in it is deleted)"
            )


def claim_output_dir(folder: str, tool: str, overwrite: bool = False) -> None:
    """Make `folder` an output folder of `tool`, refusing one that holds someone else's files.

    An absent or empty folder is created and marked; a folder marked by the same tool is reused;
    anything else is refused (FolderNotOwned) unless `overwrite` is set (then it is marked and
    written into, and still nothing in it is deleted). In a folder of the same tool, the
    temporary files of a run killed mid-write are removed.
    """
    check_output_dir(folder, tool, overwrite)
    if folder_owner(folder) == tool:
        remove_leftover_temporaries(folder)
    os.makedirs(folder, exist_ok=True)
    atomic_write_text(os.path.join(folder, OWNER_MARKER), tool + "\n")


def describe_os_error(error: OSError) -> str:
    """``PATH: problem`` for an OSError that names a path, else its own message."""
    if error.filename is None:
        return str(error)
    paths = error.filename if error.filename2 is None else f"{error.filename} -> {error.filename2}"
    return f"{paths}: {error.strerror}"


@contextlib.contextmanager
def exit_on_os_error(option: str) -> Iterator[None]:
    """For a command-line tool's reading and writing: an OSError (an unwritable --out-dir, a path
    under a regular file, a refused folder) ends the program with one line, naming `option`, the
    path and the problem, and status 1. Such a path is the user's to fix, not a bug to trace.
    """
    try:
        yield
    except OSError as error:
        sys.exit(f"error: {option}: {describe_os_error(error)}")


def replace_own_dir(folder: str, tool: str) -> None:
    """Empty `folder` for a new run of `tool`: it is removed only when absent, empty or marked
    by `tool` (so everything in it was written by `tool`), then created and marked again.

    Raises FolderNotOwned (a FileExistsError), deleting nothing, for a non-empty folder of
    anyone else.
    """
    claim_output_dir(folder, tool)
    shutil.rmtree(folder)
    claim_output_dir(folder, tool)


@contextlib.contextmanager
def staged_dir(folder: str, tool: str) -> Iterator[str]:
    """Build a folder of `tool` whole or not at all: yields an empty staging folder beside
    `folder` (``<folder>.partial``) and, when the block ends without an exception, puts it in
    `folder`'s place in two renames, the old `folder` (if any) removed after. So `folder` holds
    one run's files, all of them, or is absent (a kill between the renames); never a mixture.

    `folder` must be absent, empty or marked by `tool` (else FolderNotOwned before the block
    runs, nothing deleted); so must the staging folder, which a killed run may have left and
    which is emptied first. A failed block removes the staging folder and keeps `folder`.
    """
    check_output_dir(folder, tool)
    partial, replaced = folder + ".partial", folder + ".replaced"
    replace_own_dir(partial, tool)
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if os.path.lexists(replaced):
        replace_own_dir(replaced, tool)  # a folder of ours that a killed swap left behind
        shutil.rmtree(replaced)
    if os.path.isdir(folder):
        os.rename(folder, replaced)
    os.rename(partial, folder)
    shutil.rmtree(replaced, ignore_errors=True)


def read_json(path: str, error: Type[Exception]):
    """The JSON value of the file at ``path``; one that cannot be read, or is not JSON, raises
    ``error`` with one line naming the file and the fault."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except OSError as fault:
        raise error(f"{path}: cannot be read ({fault.strerror or fault})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as fault:
        raise error(f"{path}: not JSON ({fault})") from None
