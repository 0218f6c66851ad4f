"""A float64 emulation of torch 2.11's FlashAttention-2 operators, for tests on the CPU.

``_flash_attention_forward`` and ``_flash_attention_backward`` below take the arguments and
return the tuples of ``torch.ops.aten._flash_attention_forward`` / ``_flash_attention_backward``
of torch 2.11.0 (schema printed from the installed torch:
``torch.ops.aten._flash_attention_forward.default._schema``), so that a test can put this module
where an adapter keeps the library and run the adapter's own argument translation without a GPU.

Written from the library's contract as these sources state it, not from any adapter:

* torch 2.11.0 as installed: ``torch/_meta_registrations.py`` (``meta__flash_attention_forward``
  and ``meta__flash_attention_backward``: the output shapes, a float32 log-sum-exp of shape
  (B, H, Sq) dense and (H, total_q) packed, a uint64 ``rng_state`` of 2 and a uint64 scalar
  ``unused``), ``torch/nn/attention/varlen.py`` (the packed call), and
  ``include/ATen/native/transformers/cuda/flash_attn/flash_api.h``;
* pytorch's ``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp``
  (``set_params_fprop``: a negative left window with a right one >= 0 becomes ``seqlen_k``, a
  negative right window with a left one >= 0 becomes ``seqlen_k`` (``max_seqlen_k`` when
  packed); ``mha_fwd`` / ``mha_varlen_fwd``: windows >= ``seqlen_k`` (``max_seqlen_k``) become
  -1, ``is_causal`` sets the right window to 0, the keep threshold
  ``p_dropout_in_uint8_t = floor((1 - p) * 255)``, ``p < 1``, head dim a multiple of 8 and at most
  256), ``attention.cu`` (``_flash_attention_forward_impl``: the packed path when
  ``cum_seq_q`` is given, ``seqused_k`` reaching only the packed path) and
  ``attention_backward.cu`` (the backward takes the forward's ``rng_state`` and no
  ``seqused_k``);
* Dao-AILab/flash-attention (commit 0251105a), ``csrc/flash_attn/src/mask.h``
  (``apply_mask_local``: key j is kept for query i when
  ``max(0, i + Sk - Sq - left) <= j < min(Sk, i + 1 + Sk - Sq + right)``, with each packed
  sequence's own Sq and Sk: bottom-right alignment), ``block_info.h`` (per-sequence lengths from
  ``cu_seqlens``, ``seqused_k`` replacing the key length), ``softmax.h``
  (``normalize_softmax_lse``: the log-sum-exp is ``max * scale + log(sum)``, and **+inf** for a
  row whose sum is 0, whose output is 0), ``flash_fwd_kernel.h`` (a block of queries without keys
  writes 0 and +inf) and ``dropout.h`` (an element is kept when its random byte is
  ``<= p_dropout_in_uint8_t``; the kept weights are scaled by ``1 / (1 - p)``, the log-sum-exp
  is that of the weights before dropout).

What the emulation models on its own: the random bytes. The forward draws ``rng_state``
(seed, offset) from torch's default generator (``torch.manual_seed`` makes a call
reproducible; successive calls differ), and the keep-mask is a function of ``rng_state`` alone
(through ``torch.Generator``) indexed by (sequence, head, query row, key column) of the call, as
the kernel's Philox stream is: the same ``rng_state`` gives the same mask, in the forward and in
the backward. Rows of a packed output that no sequence covers stay unwritten in the library; here
they are NaN, so that reading them shows.

Departure from the library, for precise tests: the library takes float16 and bfloat16 on CUDA
devices; the emulation takes those and also float64, on any device (it computes on the CPU in
float64 and returns the caller's dtype and device). float32 is refused, as by the library. The
log-sum-exp is float32 whatever the input, as the library's.
"""

import math
from typing import List, Optional, Tuple

import torch

LIBRARY_DTYPES = (torch.float16, torch.bfloat16)
EMULATED_DTYPES = LIBRARY_DTYPES + (torch.float64,)  # float64: the emulation's own addition
MAX_HEAD_DIM = 256


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)


def _check_tensors(query, key, value, cum_seq_q, cum_seq_k):
    _check(query.dtype in EMULATED_DTYPES, "FlashAttention only support fp16 and bf16 data type")
    _check(key.dtype == query.dtype, "query and key must have the same dtype")
    _check(value.dtype == query.dtype, "query and value must have the same dtype")
    for t in (query, key, value):
        _check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    dim = query.shape[-1]
    _check(dim % 8 == 0, "head_size must be a multiple of 8, this is ensured by padding!")
    _check(dim <= MAX_HEAD_DIM, "FlashAttention forward only supports head dimension at most 256")
    _check(query.shape[-2] % key.shape[-2] == 0,
           "Number of heads in key/value must divide number of heads in query")  # fmt: skip
    _check((cum_seq_q is None) == (cum_seq_k is None),
           "cumulative_sequence_length_q and cumulative_sequence_length_k must be both set or "
           "both not set")  # fmt: skip
    if cum_seq_q is not None:
        for name, cum in (("cu_seqlens_q", cum_seq_q), ("cu_seqlens_k", cum_seq_k)):
            _check(cum.dtype == torch.int32, f"{name} must have dtype int32")
            _check(cum.dim() == 1 and cum.is_contiguous(), f"{name} must be contiguous")
        _check(cum_seq_q.numel() == cum_seq_k.numel(), "cu_seqlens_k must have shape (b + 1)")
        _check(cum_seq_q.numel() - 1 > 0, "batch size must be positive")
        _check(query.dim() == 3 and key.dim() == 3, "packed inputs are (total, heads, head_dim)")
    else:
        _check(query.dim() == 4 and key.dim() == 4, "dense inputs are (batch, seq, heads, dim)")
        _check(query.shape[0] > 0, "batch size must be positive")


def kernel_windows(window_size_left, window_size_right, is_causal, seqlen_q, seqlen_k):
    """The (left, right) bounds the kernels apply, or None for no window; ``seqlen_q`` and
    ``seqlen_k`` are the dense lengths or, packed, ``max_q`` and ``max_k``."""
    left = -1 if window_size_left is None else int(window_size_left)
    right = -1 if window_size_right is None else int(window_size_right)
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_k:
        right = -1
    if seqlen_q == 1:  # causal is the same as not causal for one query
        is_causal = False
    if is_causal:
        right = 0
    if left < 0 and right >= 0:
        left = seqlen_k
    if left >= 0 and right < 0:
        right = seqlen_k
    return None if left < 0 else (left, right)


def kept_keys(rows: int, keys: int, window, device=None) -> torch.Tensor:
    """(rows, keys) bool: the keys each query of one sequence attends to (bottom-right aligned)."""
    i = torch.arange(rows, device=device)[:, None]
    j = torch.arange(keys, device=device)[None, :]
    kept = (i >= 0) & (j < keys)  # (rows, keys)
    if window is not None:
        left, right = window
        diagonal = i + keys - rows  # the key position of query i
        kept = kept & (j >= diagonal - left) & (j <= diagonal + right)
    return kept


def keep_threshold(dropout_p: float) -> int:
    """A random byte <= this keeps its element (the kernels' p_dropout_in_uint8_t)."""
    return int(math.floor((1.0 - dropout_p) * 255.0))


def dropout_keep(rng_state: torch.Tensor, dropout_p: float, shape) -> Optional[torch.Tensor]:
    """(sequences, heads, max_q, max_k) bool keep-mask of the call with this ``rng_state``; None
    without dropout."""
    if dropout_p <= 0.0:
        return None
    seed, offset = (int(x) for x in rng_state.cpu().tolist())
    generator = torch.Generator().manual_seed(hash((seed, offset)) & (2**63 - 1))
    random_bytes = torch.randint(0, 256, tuple(shape), generator=generator, dtype=torch.int16)
    return random_bytes <= keep_threshold(dropout_p)


class _Sequence:
    """One sequence of a call: its query rows and key rows in the caller's tensors."""

    def __init__(self, index, q_rows, k_rows):
        self.index, self.q_rows, self.k_rows = index, q_rows, k_rows


def _sequences(query, key, cum_seq_q, cum_seq_k, max_q, max_k, seqused_k) -> List[_Sequence]:
    if cum_seq_q is None:  # dense: seqused_k does not reach this path
        return [_Sequence(b, (b, slice(None)), (b, slice(None))) for b in range(query.shape[0])]
    cq, ck = cum_seq_q.cpu().tolist(), cum_seq_k.cpu().tolist()
    used = None if seqused_k is None else seqused_k.cpu().tolist()
    sequences = []
    for b in range(len(cq) - 1):
        q_len, k_len = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        # Lengths beyond the maxima, or rows beyond the tensors, are undefined in the library.
        if not (0 <= q_len <= max_q and 0 <= k_len <= max_k):
            raise ValueError(
                f"sequence {b}: {q_len} queries and {k_len} keys exceed max_q={max_q} or "
                f"max_k={max_k} (or are negative): undefined in the library"
            )
        if cq[b + 1] > query.shape[0] or ck[b + 1] > key.shape[0]:
            raise ValueError(f"sequence {b} reaches beyond the packed tensors")
        k_used = k_len if used is None else used[b]
        sequences.append(
            _Sequence(b, (slice(cq[b], cq[b + 1]),), (slice(ck[b], ck[b] + k_used),))
        )
    return sequences


def _heads_first(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(S, H', D) -> (H, S, D) float64 on the CPU, key/value heads repeated for grouped queries."""
    x = x.detach().to("cpu", torch.float64).transpose(0, 1)
    return x.repeat_interleave(heads // x.shape[0], dim=0)


def _probabilities(q, k, window, scale, lse=None):
    """Scaled logits' softmax (H, Sq, Sk) and log-sum-exp (H, Sq), +inf for rows without keys;
    with ``lse`` given, exp(logit - lse) as the backward recomputes it."""
    rows, keys = q.shape[1], k.shape[1]
    logits = (q @ k.transpose(-1, -2)) * scale
    logits = logits.masked_fill(~kept_keys(rows, keys, window), float("-inf"))
    if lse is None:
        if keys:
            row_max = logits.amax(-1, keepdim=True)
        else:
            row_max = logits.new_full((q.shape[0], rows, 1), -math.inf)
        has_key = torch.isfinite(row_max)
        shifted = torch.where(has_key, row_max, torch.zeros_like(row_max))
        total = torch.exp(logits - shifted).sum(-1, keepdim=True)
        no_key = torch.full_like(total, math.inf)  # the kernels' log-sum-exp of an empty row
        lse = torch.where(has_key, shifted + torch.log(total), no_key).squeeze(-1)
    return torch.exp(logits - lse[..., None]), lse


def _dropout_factor(keep, sequence, rows, keys, dropout_p):
    if keep is None:
        return None
    return keep[sequence.index, :, :rows, :keys].double() / (1.0 - dropout_p)


def _scale_of(query, scale):
    return 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)


def _max_lengths(query, key, cum_seq_q, max_q, max_k):
    if cum_seq_q is None:
        return query.shape[1], key.shape[1]
    return int(max_q), int(max_k)


def _flash_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cum_seq_q: Optional[torch.Tensor],
    cum_seq_k: Optional[torch.Tensor],
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    return_debug_mask: bool,
    *,
    scale: Optional[float] = None,
    window_size_left: Optional[int] = None,
    window_size_right: Optional[int] = None,
    seqused_k: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, softmax_logsumexp, rng_state, unused, debug_attn_mask), as the library's."""
    _check_tensors(query, key, value, cum_seq_q, cum_seq_k)
    _check(dropout_p < 1.0, "dropout_p must be < 1")
    if return_debug_mask or alibi_slopes is not None:
        raise NotImplementedError("the emulation models neither return_debug_mask nor alibi_slopes")
    heads, scale = query.shape[-2], _scale_of(query, scale)
    seq_q, seq_k = _max_lengths(query, key, cum_seq_q, max_q, max_k)
    window = kernel_windows(window_size_left, window_size_right, is_causal, seq_q, seq_k)
    sequences = _sequences(query, key, cum_seq_q, cum_seq_k, max_q, max_k, seqused_k)

    rng_state = torch.zeros(2, dtype=torch.int64)
    if dropout_p > 0.0:
        rng_state = torch.randint(0, 2**62, (2,), dtype=torch.int64)
    keep = dropout_keep(rng_state, dropout_p, (len(sequences), heads, seq_q, seq_k))

    out = torch.full(query.shape, math.nan, dtype=torch.float64)
    if cum_seq_q is None:
        lse = torch.full((query.shape[0], heads, seq_q), math.nan, dtype=torch.float64)
    else:
        lse = torch.full((heads, query.shape[0]), math.nan, dtype=torch.float64)
    for s in sequences:
        q, k, v = (_heads_first(t[r], heads) for t, r in
                   ((query, s.q_rows), (key, s.k_rows), (value, s.k_rows)))  # fmt: skip
        probs, row_lse = _probabilities(q, k, window, scale)
        factor = _dropout_factor(keep, s, q.shape[1], k.shape[1], dropout_p)
        weights = probs if factor is None else probs * factor
        out[s.q_rows] = (weights @ v).transpose(0, 1)
        if cum_seq_q is None:
            lse[s.index] = row_lse
        else:
            lse[:, s.q_rows[0]] = row_lse
    device = query.device
    return (
        out.to(device, query.dtype),
        lse.to(device, torch.float32),
        rng_state.view(torch.uint64).to(device),
        torch.empty((), dtype=torch.uint64, device=device),
        torch.empty(0, dtype=query.dtype, device=device),
    )


def _flash_attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    cum_seq_q: Optional[torch.Tensor],
    cum_seq_k: Optional[torch.Tensor],
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    rng_state: torch.Tensor,
    unused: torch.Tensor,
    *,
    scale: Optional[float] = None,
    window_size_left: Optional[int] = None,
    window_size_right: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_query, grad_key, grad_value), as the library's: the weights are recomputed from the
    given log-sum-exp (exp(logit - lse): a row given -inf makes NaN, as in the kernel) and the
    dropout mask from the given ``rng_state``."""
    _check_tensors(query, key, value, cum_seq_q, cum_seq_k)
    for name, t in (("out", out), ("dout", grad_out)):
        _check(t.dtype == query.dtype, f"query and {name} must have the same dtype")
    _check(logsumexp.dtype == torch.float32, "softmax_lse must be float32")
    expected = ((query.shape[0], query.shape[-2], query.shape[1]) if cum_seq_q is None
                else (query.shape[-2], query.shape[0]))  # fmt: skip
    _check(tuple(logsumexp.shape) == expected, f"softmax_lse must have shape {expected}")
    _check(rng_state.dtype == torch.uint64 and rng_state.numel() == 2, "rng_state: uint64 of 2")
    heads, scale = query.shape[-2], _scale_of(query, scale)
    seq_q, seq_k = _max_lengths(query, key, cum_seq_q, max_q, max_k)
    window = kernel_windows(window_size_left, window_size_right, is_causal, seq_q, seq_k)
    sequences = _sequences(query, key, cum_seq_q, cum_seq_k, max_q, max_k, None)
    keep_shape = (len(sequences), heads, seq_q, seq_k)
    keep = dropout_keep(rng_state.view(torch.int64), dropout_p, keep_shape)

    dq = torch.full(query.shape, math.nan, dtype=torch.float64)
    dk = torch.full(key.shape, math.nan, dtype=torch.float64)
    dv = torch.full(value.shape, math.nan, dtype=torch.float64)
    lse64 = logsumexp.detach().to("cpu", torch.float64)
    for s in sequences:
        q, k, v, o, g = (_heads_first(t[r], heads) for t, r in
                         ((query, s.q_rows), (key, s.k_rows), (value, s.k_rows),
                          (out, s.q_rows), (grad_out, s.q_rows)))  # fmt: skip
        row_lse = lse64[s.index] if cum_seq_q is None else lse64[:, s.q_rows[0]]
        probs, _ = _probabilities(q, k, window, scale, lse=row_lse)
        factor = _dropout_factor(keep, s, q.shape[1], k.shape[1], dropout_p)
        grad_weights = g @ v.transpose(-1, -2)
        kept = probs if factor is None else probs * factor
        if factor is not None:
            grad_weights = grad_weights * factor
        delta = (g * o).sum(-1, keepdim=True)
        grad_logits = probs * (grad_weights - delta) * scale
        kv_heads = key.shape[-2]

        def per_kv_head(x):  # (H, Sk, D) -> (Sk, H_k, D): grouped query heads summed
            return x.view(kv_heads, heads // kv_heads, *x.shape[1:]).sum(1).transpose(0, 1)

        dq[s.q_rows] = (grad_logits @ k).transpose(0, 1)
        dk[s.k_rows] = per_kv_head(grad_logits.transpose(-1, -2) @ q)
        dv[s.k_rows] = per_kv_head(kept.transpose(-1, -2) @ g)
    device, dtype = query.device, query.dtype
    return dq.to(device, dtype), dk.to(device, dtype), dv.to(device, dtype)
