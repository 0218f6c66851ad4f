"""The L0-regularised criteria of Voita et al.: a fairseq loss plus the head gates' penalty."""

from . import label_smoothed_cross_entropy_l0, sentence_prediction_l0  # noqa: F401
