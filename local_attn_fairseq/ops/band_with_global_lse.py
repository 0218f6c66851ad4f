"""Pande et al.'s post-softmax band masks without a T x T matrix.

A Pande head with band ``[lo, hi]`` (offsets ``j - i``) keeps the weights of a softmax over all
allowed keys inside the band and zeroes the rest:

    out_i = sum_{j in band} exp(s_ij - LSE_i) v_j = out_band_i * exp(lse_band_i - LSE_i)

where ``LSE_i`` is the log-sum-exp of the scaled logits over every allowed key (padding excluded,
the causal mask respected), ``out_band`` the band-renormalised attention the banded operator
computes, and ``lse_band`` its log-sum-exp. So a Pande head costs one banded attention, O(T * w),
plus ``LSE``, which needs every logit but only O(T) memory when the logits are formed one block
of queries at a time (and formed again, block by block, in backward).

Gradients: with ``LSE`` held fixed, the band weights are ``p_ij = exp(s_ij - LSE_i)``; the banded
operator's backward computes exactly that gradient when it is given ``LSE`` as its log-sum-exp
and a zero output (its ``delta = dO . out`` term, which the renormalisation causes, vanishes).
``LSE`` gets ``-dO_i . out_i`` and passes it on to every logit of row i through its softmax.

Bands that do not contain the diagonal (``prev-k`` = [-k, -k], ``next-k`` = [k, k]) run on keys
and values shifted along time, so that the band contains the diagonal of the shifted sequence
(the operator's windows are non-negative); keys shifted in from outside the sequence are padding.
"""

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from . import banded_reference
from .banded_attention import choose_route, draw_dropout_keep
from .second_derivatives import gradients_with_graph

Band = Tuple[int, int]  # (lo, hi): allowed offsets lo <= j - i <= hi

# Elements of one block's (B, H, n, S) logits: bounds the transient memory of the log-sum-exp
# (a few blocks at a time). Much narrower blocks make the products too small to run well.
LSE_BLOCK_ELEMENTS = 2**22


def _query_blocks(batch_heads: int, length: int, keys: int, block_rows: Optional[int]):
    """[start, end) blocks of queries whose logits against `keys` keys stay within the budget."""
    if block_rows is None:
        block_rows = max(1, LSE_BLOCK_ELEMENTS // max(1, batch_heads * keys))
    return [(start, min(start + block_rows, length)) for start in range(0, length, block_rows)]


def _block_logits(scaled_q, kf, start, end, key_bias, causal):
    """Logits (B, H, n, S') of queries start .. end - 1 (``scaled_q``: q times the logit scale),
    -inf at padding and (causal) future keys; causal blocks only read keys up to their last
    query. A fresh tensor, free to be changed in place."""
    keys = end if causal else kf.shape[2]
    logits = torch.matmul(scaled_q[:, :, start:end], kf[:, :, :keys].transpose(-1, -2))
    if key_bias is not None:
        logits.add_(key_bias[..., :keys])
    if causal:
        query = torch.arange(start, end, device=kf.device)[:, None]
        logits.masked_fill_(torch.arange(keys, device=kf.device)[None, :] > query, float("-inf"))
    return logits


def _padding_bias(key_padding_mask: Optional[torch.Tensor], dtype) -> Optional[torch.Tensor]:
    """(B, 1, 1, S): 0 for real keys, -inf for padding."""
    if key_padding_mask is None:
        return None
    bias = torch.zeros(key_padding_mask.shape, dtype=dtype, device=key_padding_mask.device)
    return bias.masked_fill(key_padding_mask.bool(), float("-inf"))[:, None, None, :]


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """-inf (a row without keys) replaced by 0, so that exp(-inf - 0) = 0 and no NaN appears."""
    return x.masked_fill(torch.isneginf(x), 0.0)


def _rows_with_keys(key_padding_mask, batch, length, causal, device) -> torch.Tensor:
    """(B or 1, 1, T) bool: query i has at least one allowed key."""
    if key_padding_mask is None:
        return torch.ones(1, 1, length, dtype=torch.bool, device=device)
    real = ~key_padding_mask
    if causal:
        return (real.cumsum(dim=1) > 0)[:, None, :]
    return real.any(dim=1)[:, None, None].expand(batch, 1, length)


# PyTorch's flash attention for the CPU returns the row log-sum-exp of its softmax.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BACKWARD = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)


def _accumulated(q, k):
    """q and k in the log-sum-exp's accumulation dtype, contiguous."""
    acc = banded_reference.compute_dtype(q.dtype)
    return q.to(acc).contiguous(), k.to(acc).contiguous()


class _AllKeysLogSumExp(torch.autograd.Function):
    """Row log-sum-exp over all allowed keys without a T x T matrix, in both directions.

    On the CPU, through PyTorch's flash attention with the keys as values: its log-sum-exp is
    LSE, and its output o_i = sum_j a_ij k_j gives dLSE/dq_i = scale * o_i (a: the softmax over
    all keys); dLSE/dk_j = scale * sum_i a_ij q_i is the value gradient of its backward for the
    output gradient scale * q_i. Elsewhere (or with ``block_rows``), per block of queries.

    Forward and ``setup_context`` apart, as torch.func's transforms need: the forward returns
    LSE and the flash attention's output (None on the blocked route), which the backward reads.
    """

    @staticmethod
    def forward(q, k, key_padding_mask, scale, causal, block_rows):
        qf, kf = _accumulated(q, k)
        key_bias = _padding_bias(key_padding_mask, qf.dtype)
        if block_rows is None and q.device.type == "cpu" and _CPU_FLASH is not None:
            out, lse = _CPU_FLASH(qf, kf, kf, 0.0, causal, attn_mask=key_bias, scale=scale)
            # rows without keys: flash gives 0 (and a zero output); the log-sum-exp is -inf
            batch, _, length, _ = q.shape
            has_key = _rows_with_keys(key_padding_mask, batch, length, causal, q.device)
            return lse.masked_fill(~has_key, float("-inf")), out
        return _blocked_logsumexp(qf * scale, kf, key_bias, causal, block_rows), None

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, key_padding_mask, scale, causal, block_rows = inputs
        lse, flash_out = output
        ctx.save_for_backward(q, k, key_padding_mask, lse, flash_out)
        ctx.settings = (scale, causal, block_rows)
        if flash_out is not None:
            ctx.mark_non_differentiable(flash_out)

    @staticmethod
    def backward(ctx, grad_lse, _):
        scale, causal, block_rows = ctx.settings
        q, k, key_padding_mask, lse, flash_out = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph (torch.func too): differentiable gradients
            dq, dk = gradients_with_graph(
                lambda q, k: _dense_logsumexp(q, k, key_padding_mask, scale, causal), (q, k),
                grad_lse,
            )  # fmt: skip
            return dq, dk, None, None, None, None
        qf, kf = _accumulated(q, k)
        key_bias = _padding_bias(key_padding_mask, qf.dtype)
        grad = grad_lse.to(lse.dtype)
        if flash_out is not None:
            batch, _, length, _ = q.shape
            has_key = _rows_with_keys(key_padding_mask, batch, length, causal, q.device)
            grad = grad.masked_fill(~has_key, 0.0)[..., None] * scale
            dq = grad * flash_out
            # rows without keys take no gradient: any finite log-sum-exp serves them
            _, _, dk = _CPU_FLASH_BACKWARD(
                (grad * qf).contiguous(), qf, kf, kf, flash_out, _finite_or_zero(lse), 0.0,
                causal, attn_mask=key_bias, scale=scale,
            )  # fmt: skip
        else:
            scaled_q = qf * scale
            dq, dk = _blocked_logsumexp_grad(scaled_q, kf, lse, grad, key_bias, causal, block_rows)
            dq = dq * scale
        return dq.to(q.dtype), dk.to(k.dtype), None, None, None, None


def _dense_logsumexp(q, k, key_padding_mask, scale, causal) -> torch.Tensor:
    """``all_keys_logsumexp`` from every logit at once, differentiable twice (its second
    derivatives' composition); rows without keys give -inf and zero gradients."""
    acc = banded_reference.compute_dtype(q.dtype)
    logits = torch.matmul(q.to(acc) * scale, k.to(acc).transpose(-1, -2))
    allowed = torch.ones(logits.shape[-2:], dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed.tril()
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    has_key = allowed.any(-1)
    logits = logits.masked_fill(~allowed, float("-inf")).masked_fill(~has_key[..., None], 0.0)
    return torch.logsumexp(logits, -1).masked_fill(~has_key, float("-inf"))


def _blocked_logsumexp(scaled_q, kf, key_bias, causal, block_rows) -> torch.Tensor:
    batch, heads, length, _ = scaled_q.shape
    lse = scaled_q.new_empty(batch, heads, length)
    for start, end in _query_blocks(batch * heads, length, kf.shape[2], block_rows):
        logits = _block_logits(scaled_q, kf, start, end, key_bias, causal)
        row_max = _finite_or_zero(logits.amax(dim=-1, keepdim=True))
        total = logits.sub_(row_max).exp_().sum(dim=-1)
        lse[:, :, start:end] = row_max.squeeze(-1) + total.log()  # log 0 = -inf: no key
    return lse


def _blocked_logsumexp_grad(scaled_q, kf, lse, grad, key_bias, causal, block_rows):
    """Gradients of sum_i grad_i LSE_i with respect to scaled_q and k, per block of queries."""
    batch, heads, length, _ = scaled_q.shape
    safe_lse = _finite_or_zero(lse)
    dq, dk = torch.zeros_like(scaled_q), torch.zeros_like(kf)
    for start, end in _query_blocks(batch * heads, length, kf.shape[2], block_rows):
        logits = _block_logits(scaled_q, kf, start, end, key_bias, causal)
        # d LSE_i / d s_ij is the softmax over all keys, a_ij = exp(s_ij - LSE_i)
        rows = slice(start, end)
        grad_logits = logits.sub_(safe_lse[:, :, rows, None]).exp_()
        grad_logits.mul_(grad[:, :, rows, None])
        keys = grad_logits.shape[-1]
        dq[:, :, rows] = torch.matmul(grad_logits, kf[:, :, :keys])
        dk[:, :, :keys] += torch.matmul(grad_logits.transpose(-1, -2), scaled_q[:, :, rows])
    return dq, dk


def all_keys_logsumexp(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    key_padding_mask: Optional[torch.Tensor] = None,
    causal: bool = False,
    block_rows: Optional[int] = None,
) -> torch.Tensor:
    """log sum_j exp(scale * q_i . k_j) over the allowed keys j of each query: (B, H, T).

    q (B, H, T, D), k (B, H, S, D); ``key_padding_mask`` (B, S) bool, True = padding; ``causal``:
    query i sees keys j <= i. In float32 (float64 for float64 inputs); -inf for a row without
    keys; differentiable. On the CPU it runs on PyTorch's flash attention (memory O(T * D));
    on other devices, or with ``block_rows`` given, the logits are formed for ``block_rows``
    queries at a time (by default at most ``LSE_BLOCK_ELEMENTS`` elements), in forward and
    backward alike.
    """
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(
            f"all_keys_logsumexp: causal attention needs as many queries as keys, got "
            f"{q.shape[2]} and {k.shape[2]}"
        )
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.bool()
    return _AllKeysLogSumExp.apply(q, k, key_padding_mask, float(scale), causal, block_rows)[0]


# ---------------------------------------------------------------------------------------------
# The band, on the banded operator.


def _band_kernels(q: torch.Tensor, width: int, dropout_p: float):
    """(forward, backward) of the banded operator on the route ``banded_attention`` would take.

    The backward must accept a log-sum-exp other than the forward's: the compiled CUDA-core/CPU
    kernels and the PyTorch implementation do. So the tensor-core route runs on the compiled
    CUDA-core kernels, and the SDPA route (whose backward is autograd's) on PyTorch.
    """
    route = choose_route(q.device, q.dtype, q.shape[-1], width, dropout_p)
    if route in ("extension", "tensor-core"):
        return torch.ops.local_attn.banded_forward, torch.ops.local_attn.banded_backward
    return banded_reference.banded_forward, banded_reference.banded_backward


def _band_of_full_softmax(q, k, v, lse, left, right, key_padding_mask, keep, scale, dropout_p):
    """What ``_BandOfFullSoftmax`` computes, in differentiable PyTorch operations (its second
    derivatives' composition): exp(s_ij - LSE_i) over the band, dropped out, times v."""
    acc = banded_reference.compute_dtype(q.dtype)
    max_left, max_right = max(left), max(right)
    width = banded_reference.band_width(left, right)
    k_padded = F.pad(k.to(acc), (0, 0, max_left, max_right))
    logits = banded_reference.band_dot(q.to(acc), k_padded, width) * scale
    allowed = banded_reference.allowed_band(q.shape[2], left, right, key_padding_mask, q.device)
    allowed = allowed & ~torch.isneginf(lse)[..., None]  # a row without keys gets zeros
    lse, inf = lse.to(acc), float("inf")
    # -inf before exp, not 0 after it: no 0 * inf in the gradients
    weights = torch.exp((logits - _finite_or_zero(lse)[..., None]).masked_fill(~allowed, -inf))
    factor = banded_reference.keep_factor(keep, dropout_p, acc)
    if factor is not None:
        weights = weights * factor
    v_padded = F.pad(v.to(acc), (0, 0, max_left, max_right))
    return banded_reference.band_combine(weights, v_padded).to(q.dtype)


class _BandOfFullSoftmax(torch.autograd.Function):
    """sum_{j in band} exp(s_ij - LSE_i) v_j for the given LSE (see the module docstring).
    Forward and ``setup_context`` apart, as torch.func's transforms need."""

    @staticmethod
    def forward(q, k, v, lse, left, right, key_padding_mask, keep, scale, dropout_p):
        band_forward, _ = _band_kernels(q, banded_reference.band_width(left, right), dropout_p)
        out_band, lse_band = band_forward(
            q, k, v, left, right, key_padding_mask, keep, scale, dropout_p
        )
        # exp(lse_band - LSE): the full softmax's mass inside the band (0 for empty rows)
        kept_mass = torch.exp(lse_band - lse).masked_fill(torch.isneginf(lse), 0.0)
        return (out_band.to(lse.dtype) * kept_mass[..., None]).to(q.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, lse, left, right, key_padding_mask, keep, scale, dropout_p = inputs
        ctx.save_for_backward(q, k, v, output, lse, key_padding_mask, keep)
        ctx.band = (left, right, scale, dropout_p)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, key_padding_mask, keep = ctx.saved_tensors
        left, right, scale, dropout_p = ctx.band
        if torch.is_grad_enabled():  # create_graph (torch.func too): differentiable gradients
            band = (left, right, key_padding_mask, keep, scale, dropout_p)
            dq, dk, dv, grad_lse = gradients_with_graph(
                lambda q, k, v, lse: _band_of_full_softmax(q, k, v, lse, *band), (q, k, v, lse),
                grad_out,
            )  # fmt: skip
            return dq, dk, dv, grad_lse, None, None, None, None, None, None
        _, band_backward = _band_kernels(q, banded_reference.band_width(left, right), dropout_p)
        grad_out = grad_out.contiguous()
        # Weights exp(s - LSE) with LSE held fixed: no renormalisation term (zero output).
        dq, dk, dv = band_backward(
            grad_out, q, k, v, torch.zeros_like(out), lse, left, right, key_padding_mask, keep,
            scale, dropout_p,
        )  # fmt: skip
        grad_lse = -(grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
        return dq, dk, dv, grad_lse, None, None, None, None, None, None


class _ShiftGroup(NamedTuple):
    """Heads whose bands run on keys shifted by ``shift`` (key row m holds key m + shift)."""

    shift: int
    heads: List[int]
    left: List[int]
    right: List[int]


def _clip_band(band: Band, length: int, causal: bool) -> Optional[Band]:
    """The band limited to offsets a query can reach, or None when it holds no key at all."""
    lo, hi = band
    reach = max(length - 1, 0)
    lo, hi = max(lo, -reach), min(hi, 0 if causal else reach)
    return (lo, hi) if lo <= hi else None


def _shift_groups(bands: Sequence[Band], length: int, causal: bool) -> List[_ShiftGroup]:
    """Heads grouped by the key shift that puts their band around the diagonal."""
    groups: Dict[int, _ShiftGroup] = {}
    for head, band in enumerate(bands):
        clipped = _clip_band(band, length, causal)
        if clipped is None:
            continue
        lo, hi = clipped
        shift = min(max(0, lo), hi)  # the offset nearest 0 inside the band
        group = groups.setdefault(shift, _ShiftGroup(shift, [], [], []))
        group.heads.append(head)
        group.left.append(shift - lo)
        group.right.append(hi - shift)
    return [groups[s] for s in sorted(groups)]


def _shift_time(x: torch.Tensor, shift: int, fill) -> torch.Tensor:
    """Row m of the result is row m + shift of x along dim 2 (time), `fill` outside x."""
    length = x.shape[2]
    shift = max(-length, min(shift, length))
    if shift == 0:
        return x
    pad = (0, 0) * (x.dim() - 3)  # trailing dims after time
    if shift > 0:
        return F.pad(x[:, :, shift:], (*pad, 0, shift), value=fill)
    return F.pad(x[:, :, : length + shift], (*pad, -shift, 0), value=fill)


def band_of_full_softmax(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bands: Sequence[Band],
    key_padding_mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    causal: bool = False,
    lse: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Self-attention of Pande et al.'s band heads: a softmax over all allowed keys, multiplied
    by each head's 0/1 band mask, times v; no (T, T) tensor is formed.

    Args:
        q, k, v: (B, H, T, D) of one floating dtype.
        bands: per head (lo, hi), the allowed offsets lo <= j - i <= hi (identity (0, 0),
            prev-k (-k, -k), next-k (k, k), band-k (-k, k)).
        key_padding_mask: (B, T) bool, True = padding (excluded from the softmax and the band).
        scale: logit scale, default D ** -0.5.
        dropout_p: attention dropout on the band weights (kept weights times 1 / (1 - p)), drawn
            with ``draw_dropout_keep`` in band layout, one draw per group of heads sharing a
            key shift.
        causal: query i sees keys j <= i only (decoder self-attention).
        lse: the log-sum-exp over all allowed keys (B, H, T) if already computed (heads sharing
            Q/K compute it once); by default ``all_keys_logsumexp``.

    Returns (B, H, T, D) in q's dtype; a query without allowed keys gets zeros.
    """
    batch, heads, length, dim = q.shape
    if len(bands) != heads:
        raise ValueError(f"band_of_full_softmax: {len(bands)} bands for {heads} heads")
    scale = dim**-0.5 if scale is None else float(scale)
    padding = key_padding_mask.bool() if key_padding_mask is not None else None
    if lse is None:
        lse = all_keys_logsumexp(q, k, scale, padding, causal)
    outputs, order = [], []
    for group in _shift_groups(bands, length, causal):
        outputs.append(_group_output(q, k, v, lse, group, padding, scale, dropout_p))
        order.extend(group.heads)
    empty = [h for h in range(heads) if h not in order]
    if empty:  # bands wholly in the future of a causal query, or beyond the sequence
        outputs.append(q.new_zeros(batch, len(empty), length, dim))
        order.extend(empty)
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
    if order == list(range(heads)):
        return out
    inverse = torch.empty(heads, dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(heads)
    return out.index_select(1, inverse.to(q.device))


def _select_heads(x: torch.Tensor, heads: List[int]) -> torch.Tensor:
    if heads == list(range(x.shape[1])):
        return x
    return x.index_select(1, torch.tensor(heads, device=x.device))


def _group_output(q, k, v, lse, group: _ShiftGroup, padding, scale, dropout_p):
    batch, _, length, _ = q.shape
    qg, kg, vg, lse_g = (_select_heads(t, group.heads) for t in (q, k, v, lse))
    if group.shift:
        if padding is None:
            padding = torch.zeros(batch, length, dtype=torch.bool, device=q.device)
        padding = _shift_time(padding[:, None], group.shift, True)[:, 0]
        kg, vg = _shift_time(kg, group.shift, 0.0), _shift_time(vg, group.shift, 0.0)
    width = banded_reference.band_width(group.left, group.right)
    keep = draw_dropout_keep((batch, len(group.heads), length, width), dropout_p, q.device)
    return _BandOfFullSoftmax.apply(
        qg.contiguous(), kg.contiguous(), vg.contiguous(), lse_g.contiguous(), group.left,
        group.right, padding, keep, scale, float(dropout_p),
    )  # fmt: skip
