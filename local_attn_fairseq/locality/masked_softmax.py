"""Softmax over keys that gives zeros, not NaN, for a query whose every key is masked."""

import torch


def safe_softmax(logits: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax in float32 whose all ``-inf`` rows come out as zeros.

    A row can lose every key to padding and window masks together (an all-padding sentence, a
    window that falls off the sequence); the plain softmax would fill it with NaN, which then
    spreads through the layer.
    """
    logits = logits.float()
    no_key = torch.isneginf(logits).all(dim=dim, keepdim=True)
    probs = torch.softmax(logits.masked_fill(no_key, 0.0), dim=dim)
    return probs.masked_fill(no_key, 0.0)
