from . import label_smoothed_cross_entropy_l0  # noqa: F401
