from . import transformer_local  # noqa: F401
