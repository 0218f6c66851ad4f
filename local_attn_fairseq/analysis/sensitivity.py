"""Sensitivity of self-attention outputs to their inputs (Pande et al. 2021, Section 3.1).

For every encoder layer and sentence, beta[i, j] = ||dY[i] / dX[j]||_F, the Frobenius norm of
the (dim x dim) Jacobian block of the multi-head attention output Y[i] (after W_O, Eq. 2) with
respect to its input X[j]. X is what the attention module reads (the input of its Q/K/V
projections: after the layer norm in pre-LN layers), Y what it returns before dropout and the
residual, so beta measures the attention sublayer alone, as in the paper.

The averages of Eqs. 5-7 then read, for a set family A (local L_i, syntactic S_i, unrelated U_i,
see ``dependencies.token_sets``):

    gamma_A = avg_i ( avg_{j in A_i} beta[i, j] ),

over the tokens i whose A_i is not empty (a sentence without any gives no gamma_A).

The Jacobian is exact: the module runs on a batch of C copies of the sentence, copy c sums the
output coordinate (i_c, e_c) it is responsible for, and one backward pass gives the C gradient
rows dY[i_c, e_c] / dX at once; T * dim coordinates need T * dim / C passes. The module is
called as the model calls it (banded kernel, masks, windows, gates), so what is measured is
the model's own attention.
"""

from typing import Dict, Optional

import torch
from torch import Tensor, nn

from .loading import AttentionCall, self_attention

# Elements of one chunk's largest activation (batch x heads x T x T or batch x T x dim).
CHUNK_ELEMENTS = 2**24


@torch.enable_grad()
def jacobian_norms(module: nn.Module, call: AttentionCall, chunk_elements=CHUNK_ELEMENTS):
    """beta (T, T) float32 on the CPU for one sentence (bsz 1) of a self-attention module."""
    x = call.query
    if x.size(1) != 1:
        raise ValueError(
            f"sensitivity is computed one sentence at a time, got a batch of {x.size(1)}"
        )
    length, dim = x.size(0), x.size(2)
    heads = max(getattr(module, "num_heads", 1), 1)
    per_copy = length * max(heads * length, dim)
    chunk = max(1, min(length * dim, chunk_elements // per_copy))
    squared = torch.zeros(length, length, dtype=torch.float64, device=x.device)
    coordinates = torch.arange(length * dim, device=x.device)
    for start in range(0, length * dim, chunk):
        rows = coordinates[start : start + chunk]
        copies = rows.numel()
        inputs = x.detach().expand(length, copies, dim).clone().requires_grad_(True)
        padding = call.key_padding_mask
        if padding is not None:
            padding = padding.expand(copies, length)
        output, _ = self_attention(module, inputs, padding, call.attn_mask)
        position, feature = rows // dim, rows % dim
        chosen = output[position, torch.arange(copies, device=x.device), feature].sum()
        (gradient,) = torch.autograd.grad(chosen, inputs)  # (T, copies, dim)
        squared.index_add_(0, position, gradient.double().pow(2).sum(-1).transpose(0, 1))
    return squared.sqrt().float().cpu()


def set_average(values: Tensor, members: Tensor) -> Optional[float]:
    """avg_i (avg_{j in A_i} values[i, j]) over the rows i with a non-empty A_i."""
    counts = members.sum(-1)
    rows = counts > 0
    if not rows.any():
        return None
    row_means = (values * members).sum(-1)[rows] / counts[rows]
    return float(row_means.mean())


def gammas(beta: Tensor, sets: Dict[str, Tensor]) -> Dict[str, Optional[float]]:
    """Eqs. 5-7 for one sentence and layer: gamma of every token set."""
    return {name: set_average(beta, members) for name, members in sets.items()}
