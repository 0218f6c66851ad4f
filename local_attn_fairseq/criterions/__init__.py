"""The L0-regularised criterion of Voita et al.: label smoothing plus the head gates' penalty."""

from . import label_smoothed_cross_entropy_l0  # noqa: F401
