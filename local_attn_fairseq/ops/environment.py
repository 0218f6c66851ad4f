"""Environment variables read on every operator call, so that a change made through
``os.environ`` takes effect at the next call.

``os.environ.get`` of a variable that is not set raises and catches two KeyErrors; on the CPU at
the lengths where translation trains that was about 4 us of an 80 us banded attention call
(``benchmarks/host_overhead.py``), and the routes' variables are usually not set.
"""

import os
from typing import Optional


def environment_value(name: str) -> Optional[str]:
    """``os.environ.get(name)``: read from the mapping behind ``os.environ`` where CPython keeps
    one (as ``os.environ`` itself reads it, with its key encoding), else through ``os.environ``."""
    environ = os.environ
    data = getattr(environ, "_data", None)
    if not isinstance(data, dict):
        return environ.get(name)
    raw = data.get(environ.encodekey(name))
    return None if raw is None else environ.decodevalue(raw)
