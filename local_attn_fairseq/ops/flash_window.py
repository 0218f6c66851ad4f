"""The ``flash-window`` route of the banded operator: PyTorch's own FlashAttention-2 kernels.

torch (2.11) ships FlashAttention-2 as ``aten._flash_attention_forward`` /
``aten._flash_attention_backward``, with a window (``window_size_left`` / ``window_size_right``),
packed variable-length batches (``cum_seq_q`` / ``cum_seq_k``), dropout through its own RNG and
the row log-sum-exp. This module translates a banded attention call into those calls:

* Windows. The operator's query i sits at key position p = i + Tk - Tq and sees keys
  p - left[h] .. p + right[h]; the kernels align each sequence's queries with its last keys
  (bottom right) and keep keys i + Sk - Sq - left .. i + Sk - Sq + right, both bounds inclusive,
  so (left, right) pass as they are, with ``is_causal=False``. A bound that reaches every key of
  every sequence becomes -1 (unbounded), and a window without bounds runs the kernels' dense
  path. (A negative right bound is unbounded only when Sq <= Sk + 1; here Sq <= Sk always.)
* Heads grouped by window: one library call per distinct (translated) window, on a view of the
  group's heads where they are consecutive (a gathered copy otherwise), results put back in head
  order.
* Padding, on either side of a sentence, is removed by packing the real keys of each sentence,
  and the real queries (those whose own key is real), into (total, H, D) tensors with int32
  cumulative lengths; the results are scattered back, zeros (lse -inf) in padded query rows.
  Without padding the dense (B, T, H, D) layout is used: a view of the caller's tensors.
* Log-sum-exp: (B, H, Tq) dense, (H, total_q) packed, +inf for a row without keys (its output 0);
  returned as the operator's (B, H, Tq) with -inf there, and given back to the backward as the
  kernels wrote it.
* Dropout: the kernels' own Philox stream; each call's ``rng_state`` is returned by the forward
  operator and given back to the backward, so both see the same mask. The mask is not the
  operator's band-layout keep-mask (``draw_dropout_keep``): same distribution, other draws.

The two halves are operators of their own (``torch.ops.local_attn_flash_window.forward`` /
``backward``, with fake kernels), so that torch.compile traces a call without looking inside.
Packing reads the padding's per-sentence extent on the host: one device synchronisation per
forward and one per backward, with padding only.

The library is reached through ``_library`` (an object with the two aten functions), so that
tests can put an emulation of the library in its place and run this translation on the CPU;
``unsupported_reasons`` is where CUDA, dtypes, head dims and the GPU's capability are required.
"""

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

ROUTE = "flash-window"
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (32, 64, 128)  # the kernels take multiples of 8 up to 256; the GPU tests run these
MIN_CAPABILITY = (8, 0)
SECOND_DERIVATIVES = (
    f"{ROUTE} computes first derivatives only (PyTorch's flash attention backward has no "
    "derivative of its own); use LOCAL_ATTN_BANDED_IMPL=torch for second derivatives"
)

_library = torch.ops.aten  # the library call; tests replace it with an emulation


# ---------------------------------------------------------------------------------------------
# What the route takes.


def library_gap() -> Optional[str]:
    """Why this torch has no usable windowed flash attention, or None."""
    aten = torch.ops.aten
    if not hasattr(aten, "_flash_attention_forward") or not hasattr(
        aten, "_flash_attention_backward"
    ):
        return f"torch {torch.__version__} has no aten._flash_attention_forward/_backward"
    arguments = {a.name for a in aten._flash_attention_forward.default._schema.arguments}
    if not {"window_size_left", "window_size_right"} <= arguments:
        return f"torch {torch.__version__}'s aten._flash_attention_forward takes no window"
    if not torch.backends.cuda.is_flash_attention_available():
        return f"torch {torch.__version__} was built without its flash attention kernels"
    return None


def unsupported_reasons(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    left: Sequence[int],
    right: Sequence[int],
    key_padding_mask: Optional[torch.Tensor],
    dropout_p: float,
) -> List[str]:
    """What this route lacks for this call, in words (empty: it can take it). Looks at shapes,
    dtypes and devices only, never at the padding's values (no device synchronisation):
    padding inside a sentence, which the route refuses, shows when the call runs."""
    reasons = []
    gap = library_gap()
    if gap is not None:
        reasons.append(gap)
    if q.device.type != "cuda":
        reasons.append(f"it runs on CUDA devices only, not {q.device.type}")
    elif torch.cuda.get_device_capability(q.device) < MIN_CAPABILITY:
        reasons.append("it needs a GPU of compute capability 8.0 or newer")
    if q.dtype not in DTYPES:
        reasons.append(f"it takes float16 and bfloat16, not {str(q.dtype).replace('torch.', '')}")
    if q.shape[-1] not in HEAD_DIMS:
        reasons.append(f"it takes head dims {HEAD_DIMS}, not {q.shape[-1]}")
    if any(w < 0 for w in left) or any(w < 0 for w in right):
        reasons.append("it takes windows >= 0 only (a band that excludes the query has none)")
    if q.shape[2] > k.shape[2]:
        reasons.append(f"it takes no more queries than keys, not {q.shape[2]} > {k.shape[2]}")
    if dropout_p >= 1.0:
        reasons.append("its kernels take dropout_p < 1")
    return reasons


# ---------------------------------------------------------------------------------------------
# The argument translation.


def library_window(left: int, right: int, max_q: int, max_k: int) -> Tuple[int, int]:
    """The kernels' (window_size_left, window_size_right) for the operator's (left, right) on
    sequences of at most ``max_q`` queries over ``max_k`` keys, -1 for a bound that reaches
    every key (queries aligned to each sequence's last keys, at most as many as its keys)."""
    reaches_first_key = left >= max_k - 1  # the last query sees back to key 0
    reaches_last_key = right >= max_q - 1  # the first query sees the last key
    return (-1 if reaches_first_key else left), (-1 if reaches_last_key else right)


def window_groups(
    left: Sequence[int], right: Sequence[int], max_q: int, max_k: int
) -> List[Tuple[Tuple[int, int], List[int]]]:
    """((window_size_left, window_size_right), heads) for each distinct translated window, in the
    order of each group's first head."""
    groups: Dict[Tuple[int, int], List[int]] = {}
    for head, (l, r) in enumerate(zip(left, right)):
        groups.setdefault(library_window(l, r, max_q, max_k), []).append(head)
    return list(groups.items())


class Packing(NamedTuple):
    """Where each sentence's real queries and keys go in the packed (total, H, D) layout."""

    cum_seq_q: torch.Tensor  # (B + 1,) int32
    cum_seq_k: torch.Tensor
    max_q: int
    max_k: int
    query_rows: Tuple[torch.Tensor, torch.Tensor]  # (sentence, time) of each packed query
    key_rows: Tuple[torch.Tensor, torch.Tensor]


def sentence_extents(key_padding_mask: torch.Tensor) -> List[Tuple[int, int]]:
    """(first real key, number of real keys) of each sentence, read on the host at once.

    The route needs each sentence's real keys to be consecutive (padding on either side, as
    fairseq pads): padding inside a sentence is refused."""
    real = ~key_padding_mask
    length = real.shape[1]
    count = real.sum(1)
    first = real.to(torch.uint8).argmax(1)
    last = length - 1 - real.flip(1).to(torch.uint8).argmax(1)
    extents = []
    for b, (start, n, end) in enumerate(torch.stack([first, count, last], 1).tolist()):
        if n and end - start + 1 != n:
            raise ValueError(
                f"{ROUTE}: sentence {b} has padding between its real tokens; the route takes "
                "padding on either side of a sentence only (use another LOCAL_ATTN_BANDED_IMPL)"
            )
        extents.append((start, n))
    return extents


def _cumulative(lengths: List[int]) -> List[int]:
    """0, l0, l0 + l1, ... (len(lengths) + 1 values)."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _rows_of(
    cumulative: torch.Tensor, shifts: torch.Tensor, total: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sentence, time) of each of the ``total`` packed rows: sentence b's rows are packed from
    row cumulative[b] on, packed row r holding its time r + shifts[b]."""
    row = torch.arange(total, device=cumulative.device)
    # searchsorted, not repeat_interleave: the CPU's repeat_interleave costs ~20 ms a call
    sentence = torch.searchsorted(cumulative[1:], row, right=True)
    return sentence, row + shifts[sentence]


def packing(key_padding_mask: Optional[torch.Tensor], queries: int) -> Optional[Packing]:
    """The packed layout of a padded batch, or None when no sentence has padding (the dense
    layout then). Query i of a sentence is real when its key position i + Tk - Tq is."""
    if key_padding_mask is None:
        return None
    keys = key_padding_mask.shape[1]
    extents = sentence_extents(key_padding_mask)
    if all(n == keys for _, n in extents):
        return None
    shift = keys - queries  # key position of query 0
    q_starts = [max(start, shift) for start, _ in extents]
    q_lengths = [max(0, start + n - q0) for (start, n), q0 in zip(extents, q_starts)]
    k_starts, k_lengths = [s for s, _ in extents], [n for _, n in extents]
    cum_q, cum_k = _cumulative(q_lengths), _cumulative(k_lengths)
    q_shifts = [(s - shift) - c for s, c in zip(q_starts, cum_q)]
    k_shifts = [s - c for s, c in zip(k_starts, cum_k)]
    # one copy to the device for the four small tables
    tables = torch.tensor([cum_q, cum_k, q_shifts + [0], k_shifts + [0]])
    cum_q_t, cum_k_t, q_shifts_t, k_shifts_t = tables.to(key_padding_mask.device)
    return Packing(
        cum_seq_q=cum_q_t.to(torch.int32),
        cum_seq_k=cum_k_t.to(torch.int32),
        max_q=max(q_lengths),
        max_k=max(k_lengths),
        query_rows=_rows_of(cum_q_t, q_shifts_t, cum_q[-1]),
        key_rows=_rows_of(cum_k_t, k_shifts_t, cum_k[-1]),
    )


class Layout:
    """The library's layout of a call: dense (B, T, H, D) views, or packed (total, H, D)."""

    def __init__(self, key_padding_mask: Optional[torch.Tensor], queries: int, keys: int):
        self.packed = packing(key_padding_mask, queries)
        if self.packed is None:
            self.max_q, self.max_k = queries, keys
        else:
            self.max_q, self.max_k = self.packed.max_q, self.packed.max_k

    @property
    def empty(self) -> bool:
        """No real query anywhere: nothing for the kernels to do."""
        return self.packed is not None and self.packed.query_rows[0].numel() == 0

    def cum_seq(self) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        if self.packed is None:
            return None, None
        return self.packed.cum_seq_q, self.packed.cum_seq_k

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, Tq, D) -> the library's layout."""
        if self.packed is None:
            return x.transpose(1, 2)
        return x[self.packed.query_rows[0], :, self.packed.query_rows[1]]

    def keys(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return x.transpose(1, 2)
        return x[self.packed.key_rows[0], :, self.packed.key_rows[1]]

    def _scatter(self, rows, packed: torch.Tensor, shape) -> torch.Tensor:
        out = packed.new_zeros(shape)
        out[rows[0], :, rows[1]] = packed
        return out

    def query_result(self, x: torch.Tensor, shape) -> torch.Tensor:
        """The library's query-side result -> (B, H, Tq, D), zeros in padded query rows."""
        if self.packed is None:
            return x.transpose(1, 2).contiguous()
        return self._scatter(self.packed.query_rows, x, shape)

    def key_result(self, x: torch.Tensor, shape) -> torch.Tensor:
        if self.packed is None:
            return x.transpose(1, 2).contiguous()
        return self._scatter(self.packed.key_rows, x, shape)

    def lse_head_dim(self) -> int:
        return 1 if self.packed is None else 0

    def operator_lse(self, lse: torch.Tensor, shape) -> torch.Tensor:
        """The library's log-sum-exp -> (B, H, Tq) float32, -inf for rows without keys (the
        library's +inf) and for padded query rows."""
        if self.packed is not None:
            rows = self.packed.query_rows
            full = lse.new_full(shape, float("-inf"))
            full[rows[0], :, rows[1]] = lse.t()
            lse = full
        return lse.masked_fill(torch.isposinf(lse), float("-inf"))

    def library_lse(self, lse: torch.Tensor) -> torch.Tensor:
        """The operator's log-sum-exp -> the library's layout, +inf for rows without keys."""
        lse = lse.masked_fill(torch.isneginf(lse), float("inf"))
        if self.packed is None:
            return lse
        return lse[self.packed.query_rows[0], :, self.packed.query_rows[1]].t()


def _consecutive(heads: List[int]) -> bool:
    return heads == list(range(heads[0], heads[0] + len(heads)))


def _heads(x: torch.Tensor, heads: List[int], dim: int) -> torch.Tensor:
    """The given heads of x along dim: a view when they are consecutive."""
    if _consecutive(heads):
        return x.narrow(dim, heads[0], len(heads))
    return x.index_select(dim, torch.tensor(heads, device=x.device))


def _put_heads(target: torch.Tensor, part: torch.Tensor, heads: List[int], dim: int) -> None:
    if _consecutive(heads):
        target.narrow(dim, heads[0], len(heads)).copy_(part)
    else:  # index_put, not index_copy_: CUDA's index_copy_ fails under deterministic algorithms
        target.movedim(dim, 0)[torch.tensor(heads, device=target.device)] = part.movedim(dim, 0)


def _with_heads(x: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """An empty tensor shaped as x with ``heads`` heads along dim."""
    shape = list(x.shape)
    shape[dim] = heads
    return x.new_empty(shape)


def _window_kwargs(window: Tuple[int, int], scale: float) -> dict:
    return dict(scale=scale, window_size_left=window[0], window_size_right=window[1])


def _forward(q, k, v, left, right, key_padding_mask, scale, dropout_p):
    batch, heads, queries, dim = q.shape
    layout = Layout(key_padding_mask, queries, k.shape[2])
    out_shape, lse_shape = (batch, heads, queries, dim), (batch, heads, queries)
    rng_states = torch.zeros(heads, 2, dtype=torch.int64, device=q.device)
    if layout.empty or q.numel() == 0:
        no_keys = q.new_full(lse_shape, float("-inf"), dtype=torch.float32)
        return q.new_zeros(out_shape), no_keys, rng_states
    q_lib, k_lib, v_lib = layout.queries(q), layout.keys(k), layout.keys(v)
    cum_seq_q, cum_seq_k = layout.cum_seq()
    groups = window_groups(left, right, layout.max_q, layout.max_k)
    out_lib = lse_lib = None
    for window, group in groups:
        out, lse, rng_state, _, _ = _library._flash_attention_forward(
            _heads(q_lib, group, -2), _heads(k_lib, group, -2), _heads(v_lib, group, -2),
            cum_seq_q, cum_seq_k, layout.max_q, layout.max_k, dropout_p, False, False,
            **_window_kwargs(window, scale),
        )  # fmt: skip
        if dropout_p > 0.0:  # else the kernels leave rng_state unwritten
            rng_states[group] = rng_state.view(torch.int64)
        if len(groups) == 1:
            out_lib, lse_lib = out, lse
            break
        if out_lib is None:
            out_lib = torch.empty_like(q_lib)
            lse_lib = _with_heads(lse, heads, layout.lse_head_dim())
        _put_heads(out_lib, out, group, -2)
        _put_heads(lse_lib, lse, group, layout.lse_head_dim())
    return (
        layout.query_result(out_lib, out_shape),
        layout.operator_lse(lse_lib, lse_shape),
        rng_states,
    )


def _backward(
    grad_out, q, k, v, out, lse, rng_states, left, right, key_padding_mask, scale, dropout_p
):
    layout = Layout(key_padding_mask, q.shape[2], k.shape[2])
    if layout.empty or q.numel() == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    q_lib, k_lib, v_lib = layout.queries(q), layout.keys(k), layout.keys(v)
    out_lib, grad_lib = layout.queries(out), layout.queries(grad_out)
    lse_lib = layout.library_lse(lse)
    cum_seq_q, cum_seq_k = layout.cum_seq()
    unused = torch.empty((), dtype=torch.uint64, device=q.device)
    groups = window_groups(left, right, layout.max_q, layout.max_k)
    grads_lib = None
    for window, group in groups:
        grads = _library._flash_attention_backward(
            _heads(grad_lib, group, -2), _heads(q_lib, group, -2), _heads(k_lib, group, -2),
            _heads(v_lib, group, -2), _heads(out_lib, group, -2),
            _heads(lse_lib, group, layout.lse_head_dim()).contiguous(),
            cum_seq_q, cum_seq_k, layout.max_q, layout.max_k, dropout_p, False,
            rng_states[group[0]].view(torch.uint64), unused, **_window_kwargs(window, scale),
        )  # fmt: skip
        if len(groups) == 1:
            grads_lib = grads
            break
        if grads_lib is None:
            grads_lib = tuple(torch.empty_like(x) for x in (q_lib, k_lib, v_lib))
        for target, part in zip(grads_lib, grads):
            _put_heads(target, part, group, -2)
    dq, dk, dv = grads_lib
    return (
        layout.query_result(dq, q.shape),
        layout.key_result(dk, k.shape),
        layout.key_result(dv, v.shape),
    )


# ---------------------------------------------------------------------------------------------
# The operators, their fake kernels and autograd.


@torch.library.custom_op("local_attn_flash_window::forward", mutates_args=())
def flash_window_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    left: List[int],
    right: List[int],
    key_padding_mask: Optional[torch.Tensor],
    scale: float,
    dropout_p: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out (B, H, Tq, D), lse (B, H, Tq) float32 and the kernels' RNG state (H, 2) int64 (the
    uint64 (seed, offset) of the call that computed each head)."""
    return _forward(q, k, v, left, right, key_padding_mask, scale, dropout_p)


@flash_window_forward.register_fake
def _fake_forward(q, k, v, left, right, key_padding_mask, scale, dropout_p):
    batch, heads, queries, _ = q.shape
    return (
        q.new_empty(q.shape),
        q.new_empty((batch, heads, queries), dtype=torch.float32),
        q.new_empty((heads, 2), dtype=torch.int64),
    )


@torch.library.custom_op("local_attn_flash_window::backward", mutates_args=())
def flash_window_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    rng_states: torch.Tensor,
    left: List[int],
    right: List[int],
    key_padding_mask: Optional[torch.Tensor],
    scale: float,
    dropout_p: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k and v, by the kernels' backward with the forward's RNG states."""
    return _backward(
        grad_out, q, k, v, out, lse, rng_states, left, right, key_padding_mask, scale, dropout_p
    )


@flash_window_backward.register_fake
def _fake_backward(grad_out, q, k, v, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_forward(ctx, inputs, output):
    q, k, v, left, right, key_padding_mask, scale, dropout_p = inputs
    out, lse, rng_states = output
    ctx.save_for_backward(q, k, v, out, lse, rng_states, key_padding_mask)
    ctx.band = (left, right, scale, dropout_p)
    ctx.mark_non_differentiable(lse, rng_states)


def _differentiate_forward(ctx, grad_out, grad_lse, grad_rng_states):
    q, k, v, out, lse, rng_states, key_padding_mask = ctx.saved_tensors
    left, right, scale, dropout_p = ctx.band
    dq, dk, dv = flash_window_backward(
        grad_out.contiguous(), q, k, v, out, lse, rng_states, left, right, key_padding_mask,
        scale, dropout_p,
    )  # fmt: skip
    return dq, dk, dv, None, None, None, None, None


def _save_nothing(ctx, inputs, output):
    pass


def _refuse_second_derivatives(ctx, *grads):
    raise RuntimeError(SECOND_DERIVATIVES)


flash_window_forward.register_autograd(_differentiate_forward, setup_context=_save_forward)
flash_window_backward.register_autograd(_refuse_second_derivatives, setup_context=_save_nothing)


def flash_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    left: Sequence[int],
    right: Sequence[int],
    key_padding_mask: Optional[torch.Tensor],
    scale: float,
    dropout_p: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """out (B, H, Tq, D) in q's dtype and lse (B, H, Tq) float32 (natural log of the sum of
    exp(scale * q.k) over the allowed keys; -inf for a row with no allowed key, whose out row is
    zeros). q (B, H, Tq, D); k, v (B, H, Tk, D) with Tq <= Tk; query i sits at key position
    i + Tk - Tq. left[h], right[h] >= 0 per head: query at key position p sees keys
    p - left[h] .. p + right[h] that exist and are not padding (key_padding_mask (B, Tk) bool,
    True = padding, on either side of a sentence). Rows whose query is itself padding are zeros
    (lse -inf). Differentiable in q, k and v (first derivatives; second derivatives refused).

    Runs the library whatever the device: ``unsupported_reasons`` says which calls it takes."""
    out, lse, _ = flash_window_forward(
        q, k, v, [int(w) for w in left], [int(w) for w in right],
        None if key_padding_mask is None else key_padding_mask.bool(), float(scale),
        float(dropout_p),
    )  # fmt: skip
    return out, lse
