from . import transformer_local  # noqa: F401
from . import transformer_lm_local  # noqa: F401
from . import roberta_local  # noqa: F401
from . import s2t_transformer_local  # noqa: F401
