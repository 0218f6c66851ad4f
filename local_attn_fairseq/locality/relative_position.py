"""Relative position representations (Shaw et al. 2018), as Yang et al. combine them with localness.

Keys (and optionally values) get a learned vector per clipped relative distance
``clip(j - i, -k, k)``, shared by all heads of a layer:

    e_ij = q_i (k_j + a^K_ij)^T / sqrt(d),     z_i = sum_j alpha_ij (v_j + a^V_ij).

Queries are aligned to the last keys (as in ``fixed_masks.offset_mask``), so full sequences and
incremental decoding see the same distances, and the shared padding offset of self-attention
leaves distances between real tokens unchanged.
"""

from typing import Optional

import torch
from torch import Tensor, nn


def relative_distance_index(tgt_len: int, src_len: int, max_distance: int, device) -> Tensor:
    """(tgt_len, src_len) indices into the 2k+1 embeddings: clip(j - i, -k, k) + k."""
    query_pos = torch.arange(src_len - tgt_len, src_len, device=device)
    key_pos = torch.arange(src_len, device=device)
    distance = (key_pos[None, :] - query_pos[:, None]).clamp(-max_distance, max_distance)
    return distance + max_distance


class RelativePositions(nn.Module):
    def __init__(self, head_dim: int, max_distance: int, values: bool = False):
        super().__init__()
        if max_distance < 1:
            raise ValueError(
                f"relative position clipping distance must be >= 1, got {max_distance}"
            )
        self.max_distance = max_distance
        self.key_embeddings = nn.Parameter(torch.empty(2 * max_distance + 1, head_dim))
        self.value_embeddings = (
            nn.Parameter(torch.empty(2 * max_distance + 1, head_dim)) if values else None
        )
        for p in (self.key_embeddings, self.value_embeddings):
            if p is not None:
                nn.init.xavier_uniform_(p)

    def index(self, tgt_len: int, src_len: int, device) -> Tensor:
        return relative_distance_index(tgt_len, src_len, self.max_distance, device)

    def key_logits(self, q: Tensor, index: Tensor) -> Tensor:
        """q (bsz, heads, tgt, d), already scaled -> (bsz, heads, tgt, src) logit terms."""
        per_distance = torch.matmul(q, self.key_embeddings.to(q.dtype).t())  # (b, h, t, 2k+1)
        return per_distance.gather(-1, index.expand(*q.shape[:2], *index.shape))

    def value_term(self, probs: Tensor, index: Tensor) -> Optional[Tensor]:
        """sum_j alpha_ij a^V_ij, (bsz, heads, tgt, d); None without value embeddings."""
        if self.value_embeddings is None:
            return None
        buckets = probs.new_zeros(*probs.shape[:3], self.value_embeddings.size(0))
        buckets.scatter_add_(-1, index.expand_as(probs), probs)
        return torch.matmul(buckets, self.value_embeddings.to(probs.dtype))
