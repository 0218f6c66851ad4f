"""Attention bias of heads towards token sets (Pande et al. 2021, Section 3.2, Eq. 8).

For head h, token i and a set of tokens A_i,

    a_h(i, A_i) = ( sum_{j in A_i} alpha_h[i, j] / |A_i| ) / ( sum_{j in T} alpha_h[i, j] / |T| ),

the average weight on A_i over the average weight on the whole sentence T: 1 for a head that
spreads its weight evenly, large for a head that concentrates on A_i. A head's score for a
sentence averages a_h over the tokens i with a non-empty A_i and some weight on the sentence
(a row that is all zero, as a ``prev-1`` mask gives the first token, has no ratio); its final
score averages the sentence scores. With A_i = L_i (|i - j| <= 2) this is the locality bias,
with A_i = S_i (syntactically related, not local) the non-local syntactic bias. T is the
sentence's own pieces: the end-of-sentence symbol is left out of numerator and denominator.
"""

from typing import Dict, List, Tuple

import torch
from torch import Tensor

THRESHOLDS = (1, 2, 3, 4, 5)  # Figure 2
MAP_THRESHOLD = 3  # Figure 3


def sentence_bias(weights: Tensor, members: Tensor) -> Tuple[Tensor, Tensor]:
    """Eq. 8 averaged over one sentence's tokens, for every head.

    weights: (heads, T, T) attention of the sentence's own tokens; members: (T, T) bool, row i
    the set A_i. Returns the (heads,) scores and a (heads,) bool saying which are defined."""
    members = members.to(weights.dtype)
    counts = members.sum(-1)  # |A_i|
    numerator = (weights * members).sum(-1) / counts.clamp_min(1)
    denominator = weights.mean(-1)
    valid = (counts > 0) & (denominator > 0)
    ratio = torch.where(valid, numerator / torch.where(valid, denominator, 1.0), 0.0)
    tokens = valid.sum(-1)
    return ratio.sum(-1) / tokens.clamp_min(1), tokens > 0


class BiasScores:
    """Running per-head sentence averages, per (layer, set name)."""

    def __init__(self):
        self.sums: Dict[Tuple[int, str], Tensor] = {}
        self.counts: Dict[Tuple[int, str], Tensor] = {}

    def add(self, layer: int, name: str, scores: Tensor, defined: Tensor):
        key = (layer, name)
        if key not in self.sums:
            self.sums[key] = torch.zeros_like(scores, dtype=torch.float64)
            self.counts[key] = torch.zeros_like(scores, dtype=torch.long)
        self.sums[key] += torch.where(defined, scores.double(), 0.0)
        self.counts[key] += defined.long()

    def scores(self, layer: int, name: str) -> List[float]:
        """Each head's mean over the sentences where it was defined (None where never)."""
        sums, counts = self.sums[(layer, name)], self.counts[(layer, name)]
        return [float(s / c) if c > 0 else None for s, c in zip(sums.tolist(), counts.tolist())]


def fraction_above(scores: List[float], threshold: float) -> float:
    """Share of the heads (with a defined score) whose score exceeds the threshold."""
    defined = [s for s in scores if s is not None]
    return sum(s > threshold for s in defined) / len(defined) if defined else 0.0
