"""Thin fairseq registrations of the plugin's models; the locality options they share.

- ``transformer_local``: MT (``transformer_local``, ``transformer_local_tied``,
  ``transformer_localness``, ``transformer_dynwin`` and their sizes);
- ``transformer_lm_local``: language models; ``roberta_local``: sentence classification;
- ``s2t_transformer_local``: speech-to-text (Alastruey et al.'s windows);
- ``locality_options``: the command-line options every model shares and the spec they build;
- ``resume_check``, ``precision_check``: refusals before training (a resumed run trained with
  other locality options, a half-precision setting that cannot work).
"""

from . import transformer_local  # noqa: F401
from . import transformer_lm_local  # noqa: F401
from . import roberta_local  # noqa: F401
from . import s2t_transformer_local  # noqa: F401
