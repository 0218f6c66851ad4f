"""local_attn_fairseq: local attention for fairseq (``--user-dir local_attn_fairseq``).

Importing the package applies the stack's compatibility shims and registers the plugin's
models and criterions with fairseq.
"""

from . import compat

compat.apply()

from . import criterions, models  # noqa: E402,F401  (registers them with fairseq)

__version__ = "0.1.0"
