"""Banded attention in plain PyTorch: the reference of the compiled kernels and their fallback.

Same semantics and the same two-function interface as the ``local_attn::banded_forward`` and
``local_attn::banded_backward`` operators (see ``banded_attention.py``), on any device. Memory is
O(T * w): everything lives in band layout (B, H, T, W), column c of query i being key
i - max_left + c, and no T x T matrix is formed. Keys are padded by max_left / max_right along
time so that the W keys of query i are rows i .. i + W - 1 of the padded tensor. Products run
per block of n queries as dense matmuls with the block's n + W - 1 keys (a rectangle whose
diagonal strip is the band), with n chosen so that the rectangle stays below CHUNK_ELEMENTS:
memory is O(T * w) plus a constant.
"""

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 for float64 inputs, float32 otherwise (as the kernels)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def band_width(left: Sequence[int], right: Sequence[int]) -> int:
    return max(left) + max(right) + 1


def allowed_band(
    length: int,
    left: Sequence[int],
    right: Sequence[int],
    key_padding_mask: Optional[torch.Tensor],
    device: torch.device,
) -> torch.Tensor:
    """(B or 1, H, T, W) bool: band column c of query i holds an allowed key.

    Key j = i - max_left + c is allowed for head h when -left[h] <= j - i <= right[h],
    0 <= j < T and j is not padding.
    """
    max_left, width = max(left), band_width(left, right)
    offset = torch.arange(width, device=device) - max_left  # j - i of each column
    key = torch.arange(length, device=device)[:, None] + offset  # (T, W)
    in_sequence = (key >= 0) & (key < length)
    lefts = torch.tensor(list(left), device=device)[:, None, None]
    rights = torch.tensor(list(right), device=device)[:, None, None]
    in_window = (offset >= -lefts) & (offset <= rights)  # (H, 1, W)
    allowed = (in_sequence & in_window).unsqueeze(0)  # (1, H, T, W)
    if key_padding_mask is not None:
        padded = F.pad(key_padding_mask.bool(), (max_left, max(right)), value=True)
        allowed = allowed & ~padded.unfold(1, width, 1).unsqueeze(1)  # (B, 1, T, W) view
    return allowed


def _pad_time(x: torch.Tensor, max_left: int, max_right: int) -> torch.Tensor:
    return F.pad(x, (0, 0, max_left, max_right))


# Elements of one block's (B, H, n, n + W - 1) logits rectangle: bounds the transient memory
# whatever T and w are.
CHUNK_ELEMENTS = 2**21


def _query_blocks(batch_heads: int, length: int, width: int):
    """[start, end) blocks of queries; a block of n queries sees n + W - 1 consecutive keys."""
    size = min(length, max(64, width))
    while size > 1 and batch_heads * size * (size + width - 1) > CHUNK_ELEMENTS:
        size //= 2
    return [(start, min(start + size, length)) for start in range(0, length, size)]


def _band_of(rect: torch.Tensor, width: int) -> torch.Tensor:
    """View of the band inside a block rectangle: entry (r, c) is rect[r, r + c]."""
    batch, heads, rows, _ = rect.shape
    strides = (rect.stride(0), rect.stride(1), rect.stride(2) + rect.stride(3), rect.stride(3))
    return rect.as_strided((batch, heads, rows, width), strides, rect.storage_offset())


def _rect_of(band: torch.Tensor) -> torch.Tensor:
    """The (B, H, n, n + W - 1) rectangle holding a block's band, zero elsewhere."""
    batch, heads, rows, width = band.shape
    rect = band.new_zeros(batch, heads, rows, rows + width - 1)
    _band_of(rect, width).copy_(band)
    return rect


def band_dot(rows: torch.Tensor, keys_padded: torch.Tensor, width: int) -> torch.Tensor:
    """(B, H, T, W): dot product of row i with padded key row i + c, for each column c."""
    batch, heads, length, _ = rows.shape
    out = rows.new_empty(batch, heads, length, width)
    for start, end in _query_blocks(batch * heads, length, width):
        keys = keys_padded[:, :, start : end + width - 1]
        out[:, :, start:end] = _band_of(rows[:, :, start:end] @ keys.transpose(-1, -2), width)
    return out


def band_combine(weights: torch.Tensor, values_padded: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D): sum over columns c of weights[..., c] * padded value row i + c."""
    batch, heads, length, width = weights.shape
    out = weights.new_empty(batch, heads, length, values_padded.shape[-1])
    for start, end in _query_blocks(batch * heads, length, width):
        rect = _rect_of(weights[:, :, start:end])
        out[:, :, start:end] = rect @ values_padded[:, :, start : end + width - 1]
    return out


def band_scatter(weights: torch.Tensor, rows: torch.Tensor, max_left: int, max_right: int):
    """(B, H, T, D): the transpose of band_combine, sum over queries i of the key j they use."""
    batch, heads, length, width = weights.shape
    padded = _pad_time(torch.zeros_like(rows), max_left, max_right)
    for start, end in _query_blocks(batch * heads, length, width):
        rect = _rect_of(weights[:, :, start:end])
        padded[:, :, start : end + width - 1] += rect.transpose(-1, -2) @ rows[:, :, start:end]
    return padded[:, :, max_left : max_left + length]


def keep_factor(dropout_keep: Optional[torch.Tensor], dropout_p: float, dtype: torch.dtype):
    """Multiplier of each band weight under dropout: keep / (1 - p) (0 everywhere when p == 1)."""
    if dropout_keep is None:
        return None
    scale = 1.0 / (1.0 - dropout_p) if dropout_p < 1.0 else 0.0
    return dropout_keep.to(dtype) * scale


def band_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    left: Sequence[int],
    right: Sequence[int],
    key_padding_mask: Optional[torch.Tensor],
    scale: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Softmax over each query's allowed keys in band layout, and its log-sum-exp.

    Rows without an allowed key get zero weights and a log-sum-exp of -inf. Differentiable
    with plain autograd (used for ``return_weights``).
    """
    acc = compute_dtype(q.dtype)
    max_left, max_right, width = max(left), max(right), band_width(left, right)
    logits = band_dot(q.to(acc), _pad_time(k.to(acc), max_left, max_right), width) * scale
    allowed = allowed_band(q.shape[2], left, right, key_padding_mask, q.device)
    logits = logits.masked_fill(~allowed, float("-inf"))
    row_max = logits.amax(-1, keepdim=True)
    empty = torch.isneginf(row_max)
    row_max = torch.where(empty, torch.zeros_like(row_max), row_max)
    unnormalised = torch.exp(logits - row_max)
    total = unnormalised.sum(-1, keepdim=True)
    # Empty rows divide (and take the log of) 1 instead of 0: no NaN, in values or gradients.
    safe_total = torch.where(empty, torch.ones_like(total), total)
    probs = unnormalised / safe_total
    lse = torch.where(empty, torch.full_like(total, float("-inf")), row_max + torch.log(safe_total))
    return probs, lse.squeeze(-1)


def banded_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    left: List[int],
    right: List[int],
    key_padding_mask: Optional[torch.Tensor],
    dropout_keep: Optional[torch.Tensor],
    scale: float,
    dropout_p: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Output (B, H, T, D) in q's dtype and row log-sum-exp (B, H, T) in the compute dtype."""
    acc = compute_dtype(q.dtype)
    probs, lse = band_probs(q, k, left, right, key_padding_mask, scale)
    factor = keep_factor(dropout_keep, dropout_p, acc)
    weights = probs if factor is None else probs * factor
    out = band_combine(weights, _pad_time(v.to(acc), max(left), max(right)))
    return out.to(q.dtype), lse


def banded_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    left: List[int],
    right: List[int],
    key_padding_mask: Optional[torch.Tensor],
    dropout_keep: Optional[torch.Tensor],
    scale: float,
    dropout_p: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k and v, recomputing the band weights from the saved log-sum-exp."""
    acc = compute_dtype(q.dtype)
    max_left, max_right, width = max(left), max(right), band_width(left, right)
    qf, kf, vf, gf = (t.to(acc) for t in (q, k, v, grad_out))
    k_padded, v_padded = _pad_time(kf, max_left, max_right), _pad_time(vf, max_left, max_right)
    allowed = allowed_band(q.shape[2], left, right, key_padding_mask, q.device)
    logits = band_dot(qf, k_padded, width) * scale
    # Empty rows have lse = -inf and no allowed column, so `where` discards their exp(+inf).
    probs = torch.where(allowed, torch.exp(logits - lse.unsqueeze(-1)), torch.zeros_like(logits))
    grad_weights = band_dot(gf, v_padded, width)
    factor = keep_factor(dropout_keep, dropout_p, acc)
    if factor is not None:
        grad_weights = grad_weights * factor
    # sum_c P_c dP_c = dO . out, with or without dropout (out already carries the mask).
    delta = (gf * out.to(acc)).sum(-1, keepdim=True)
    grad_logits = probs * (grad_weights - delta) * scale
    kept = probs if factor is None else probs * factor
    dq = band_combine(grad_logits, k_padded)
    dk = band_scatter(grad_logits, qf, max_left, max_right)
    dv = band_scatter(kept, gf, max_left, max_right)
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)
