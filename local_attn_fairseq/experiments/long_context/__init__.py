"""Long contexts on the CPU: fairseq's ``transformer_lm`` against ``transformer_lm_local`` with
every decoder head ``local-W``, and with mixed layers (some global heads, the rest ``local-W``),
in training and in incremental decoding (``benchmarks/long_context.py``).

- ``settings``: the run's sizes (full and quick) and the three models it compares;
- ``models``: the models built by fairseq's own argument parsing, and their trainer (Adam on
  one sequence of T tokens);
- ``memory``: the training memory of a model at T, measured (the peak of torch's allocations
  from its construction through two steps) and estimated before it runs (its T^2 term measured
  at short lengths, the rest extrapolated linearly);
- ``training``: every model at one T: the fit and time checks, the memory, the timed
  alternating rounds;
- ``decoding``: greedy decoding one token at a time through fairseq's incremental state, the
  rolling window cache against the full one, then the rolling cache alone to longer lengths;
- ``benchmark``: the whole run and its JSON record; ``report``: the record as markdown, and a
  record read back; ``plot``: the record's figure (time and memory against T).
"""

from .benchmark import run
from .report import report
from .settings import FULL_SIZES, QUICK_SIZES, Settings

__all__ = ["FULL_SIZES", "QUICK_SIZES", "Settings", "report", "run"]
