"""Which malloc serves torch's CPU tensors, and running a program again under tcmalloc.

glibc's malloc returns every freed block above its mmap threshold (32 MiB at most) to the kernel,
so a training step at long T, whose activations are all that large, faults in and zeroes fresh
pages for each of them at every step: at T = 16384 (512 dims) 150 page faults a token against 23
at 4096, and time per token 1.50x at 65536 against 4096 though the work per token is the same
(docs/benchmarks.md). tcmalloc keeps freed spans for the next step: no faults after the first
step, and time per token flat in T. A process cannot change its malloc once started, so the
choice is made by preloading the library (``LD_PRELOAD``) before the interpreter starts; this
module finds the library, says which malloc a process has, and starts a program again with it.
"""

import ctypes.util
import os
import sys
from typing import Dict, Mapping, Optional

# names ld.so resolves (Debian: libtcmalloc-minimal4, or libgoogle-perftools4 for the full one)
TCMALLOC_NAMES = ("tcmalloc_minimal", "tcmalloc")
# tcmalloc prints a line for every allocation over 1 GiB; a long context makes many
TCMALLOC_QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 50)}
# set in the program started again, so that a library that does not load is not retried forever
RESTARTED_VARIABLE = "LOCAL_ATTN_RESTARTED_UNDER"
_PREFIXES = {"libtcmalloc": "tcmalloc", "libjemalloc": "jemalloc"}


def loaded_allocator(maps_path: str = "/proc/self/maps") -> str:
    """``tcmalloc``, ``jemalloc`` or ``glibc``: the malloc mapped into this process (glibc's
    where neither of the others is, or where the maps cannot be read)."""
    try:
        with open(maps_path, encoding="utf-8") as maps:
            names = {os.path.basename(line.split()[-1]) for line in maps if "/" in line}
    except OSError:
        return "glibc"
    for name in names:
        for prefix, allocator in _PREFIXES.items():
            if name.startswith(prefix):
                return allocator
    return "glibc"


def find_tcmalloc() -> Optional[str]:
    """The name ld.so knows tcmalloc by, or None where it is not installed."""
    for name in TCMALLOC_NAMES:
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def preload_environment(environ: Mapping[str, str], library: str) -> Dict[str, str]:
    """``environ`` with ``library`` first in LD_PRELOAD (what was preloaded before stays) and
    tcmalloc's reports of large allocations silenced."""
    env = dict(environ)
    env["LD_PRELOAD"] = " ".join(filter(None, (library, env.get("LD_PRELOAD", ""))))
    for name, value in TCMALLOC_QUIET.items():
        env.setdefault(name, value)
    env[RESTARTED_VARIABLE] = library
    return env


def restart_under_tcmalloc() -> str:
    """Start this program again (the same interpreter, options and arguments) with tcmalloc
    preloaded, unless it already runs under it. Returns only where it does not start again:
    ``""`` when tcmalloc serves this process, else why it cannot (a line to show the user)."""
    if loaded_allocator() == "tcmalloc":
        return ""
    library = find_tcmalloc()
    if library is None:
        return (
            "tcmalloc is not installed (Debian: apt-get install libtcmalloc-minimal4; "
            "scripts/setup_env.sh installs it)"
        )
    if os.environ.get(RESTARTED_VARIABLE):
        return f"{os.environ[RESTARTED_VARIABLE]} was preloaded but did not load"
    script = os.path.abspath(sys.argv[0])
    if script not in (os.path.abspath(arg) for arg in sys.orig_argv):
        # run from inside another program (runpy, a test): starting again would start that one
        return f"{sys.argv[0]} does not run as its own process here: preload tcmalloc yourself"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, preload_environment(os.environ, library))
    raise AssertionError("unreachable: execve returns only by raising")


# glibc's largest mmap threshold: every freed block of this size or more goes back to the kernel
GLIBC_MMAP_THRESHOLD_MAX = 32 * 2**20


def slow_malloc_warning(tokens: int, dims: int) -> Optional[str]:
    """The line to log where glibc's malloc serves this process and one sequence's activations
    (``tokens`` x ``dims`` float32 numbers) are each over its mmap threshold, so that every
    training step faults them in again; None otherwise."""
    if tokens * dims * 4 < GLIBC_MMAP_THRESHOLD_MAX:
        return None
    if loaded_allocator() != "glibc":
        return None
    return (
        f"sequences of {tokens} tokens on the CPU under glibc's malloc, which returns every "
        "activation of that size to the kernel and faults it in again at every step (training "
        "time per token 1.5x at 65536 against 4096 tokens); preload tcmalloc for a flat "
        "time per token: LD_PRELOAD=libtcmalloc_minimal.so.4 (Debian: libtcmalloc-minimal4)"
    )
