"""C++ operators of the per-head mechanisms on the CPU: Gaussian localness, dynamic windows,
and the dense attention that takes their terms.

At the lengths where translation trains, Yang et al.'s Gaussian bias and Nguyen et al.'s
window masks are dozens of small PyTorch operations a call, each with its autograd node, and
cost more than the attention they modify. Six operators of the banded attention's extension
(csrc/mechanisms_cpu.cpp) compute them in one call forward and one backward each:
``gaussian_localness`` (the bias), ``dynamic_window_mask`` (the pointers and the mask M),
``additive_window_term`` (M times the additive window's local scores, for a layer whose every
head is an AW head), ``dense_attention`` (softmax of the logits plus an additive term, times a
multiplier, dropout, times v), and the dense attention with its mechanism in one call for a
layer whose every head is a Gaussian head (``gaussian_attention``) or a dynamic-window head of
one window (``window_attention``: MW's mask or AW's term). A seventh, ``project_heads``
(csrc/projections_cpu.cpp), makes a layer's projections of one input (its queries, keys,
values, pointer keys and local keys) in one call: at these lengths the nn.Linear calls around
an attention cost as much as the attention.
``locality/gaussian.py``, ``locality/dynamic_window.py`` and ``LocalMultiheadAttention``
define the computations and call these operators when
:func:`cpu_operators_apply`; everywhere else (GPUs, half precision, an unbuilt extension) they
compute them in PyTorch, with the same results. ``torch.compile`` traces the operators through
their fake kernels (the end of this module); their Autograd kernels refuse second derivatives
(csrc/operator_autograd.h), which ``LOCAL_ATTN_MECHANISM_IMPL=torch`` computes.

``LOCAL_ATTN_MECHANISM_IMPL=torch`` keeps every call in PyTorch (``auto``, the default, uses
the operators where they apply). ``sdpa`` is ``auto`` plus one route that no GPU has measured
yet, so that ``auto`` does not take it: a layer whose only mechanism is the Gaussian bias on
every head hands the bias to ``scaled_dot_product_attention`` as its additive mask (on a GPU,
softmax, dropout and both products in one fused kernel, where the backend takes a mask that
needs a gradient), instead of float32 logits, softmax, dropout and product, one operation each.
"""

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .banded_attention import _op_defined, load_extension
from .environment import environment_value

IMPL_ENV = "LOCAL_ATTN_MECHANISM_IMPL"
IMPLS = ("auto", "torch", "sdpa")


class _OperatorState:
    available: Optional[bool] = None  # whether the extension has them (asked once)


def _operators_built() -> bool:
    if _OperatorState.available is None:
        _OperatorState.available = load_extension() is not None and _op_defined(
            "project_heads"
        )
        register_fake_kernels()
    return _OperatorState.available


def _chosen_impl() -> str:
    choice = environment_value(IMPL_ENV) or "auto"
    if choice not in IMPLS:
        raise ValueError(f"{IMPL_ENV}={choice!r}: use one of {', '.join(IMPLS)}")
    return choice


def cpu_operators_apply(*tensors: Tensor) -> bool:
    """Whether a call on these tensors goes through the C++ operators: every tensor float32 on
    the CPU, the extension built with them, no CPU autocast (whose casts belong to PyTorch's own
    operations), and not switched off by ``LOCAL_ATTN_MECHANISM_IMPL=torch``."""
    if _chosen_impl() == "torch":
        return False
    if torch.is_autocast_enabled("cpu"):
        return False
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return False
    return _operators_built()


def gaussian_bias_through_sdpa() -> bool:
    """Whether a layer whose every head has the Gaussian bias, and no other mechanism, gives the
    bias to ``scaled_dot_product_attention`` (``LOCAL_ATTN_MECHANISM_IMPL=sdpa``)."""
    return _chosen_impl() == "sdpa"


def project_heads(
    x: Tensor, projections: Sequence[Tuple[Tensor, Optional[Tensor]]], head_dim: int
) -> List[Tensor]:
    """F.linear(x, weight, bias) of x (len, bsz, dim) for each (weight, bias) of
    ``projections``, split into heads of ``head_dim``: (bsz, rows // head_dim, len, head_dim)
    each, as views of the products. One autograd node for all of them; an output that takes
    no part in the loss gives its weight a zero gradient (not None)."""
    weights = [weight for weight, _ in projections]
    biases = [bias for _, bias in projections]
    return torch.ops.local_attn.project_heads(x, weights, biases, head_dim)


class GaussianInputs(NamedTuple):
    """What the Gaussian bias's operators read (locality/gaussian.py's definitions): the queries
    (B, T, d), W_p (d, d), U_p (H, d), and U_d (H, d) for windows from the queries (the query
    strategy) or the windows (H,) (the fixed and head strategies), never both; the span P may
    reach and the real length I, each (B, T); the keys' positions among the real keys (B, S);
    the offset added to windows from U_d and the smallest window."""

    query: Tensor
    w_p: Tensor
    u_p: Tensor
    u_d: Optional[Tensor]
    span: Tensor
    length: Tensor
    positions: Tensor
    window: Optional[Tensor]
    window_offset: float
    min_window: float


def gaussian_localness(
    gaussian: GaussianInputs, logits: Optional[Tensor]
) -> Tuple[Tensor, Tensor, Tensor]:
    """``logits + G`` (or G alone when logits is None), the centres P and the windows D, each
    (B, H, T) and detached."""
    g = gaussian
    return torch.ops.local_attn.gaussian_localness(
        g.query, g.w_p, g.u_p, g.u_d, g.span, g.length, g.positions, g.window, logits,
        g.window_offset, g.min_window,
    )  # fmt: skip


class WindowInputs(NamedTuple):
    """What the dynamic window's operators read (locality/dynamic_window.py's definitions): the
    queries (B, T, d), w_q [W_L^Q; W_R^Q], the projected pointer keys (B, 2H, S, d_h); the keys
    each query may point to, bool broadcastable to (B, 1, T, S), or None for all; the real keys
    (B, S) bool or None; the first and the last key of each key's segment (B, S) int64, or None
    for token windows."""

    query: Tensor
    w_q: Tensor
    keys: Tensor
    visible: Optional[Tensor]
    real: Optional[Tensor]
    segment_start: Optional[Tensor]
    segment_end: Optional[Tensor]


class LocalScoreInputs(NamedTuple):
    """The additive window's local scores s_loc = (scale (query local_w^T + local_b))
    local_keys^T per head: local_w (H d_l, d), local_b (H d_l,) or None, local_keys
    (B, H, S, d_l)."""

    local_w: Tensor
    local_b: Optional[Tensor]
    local_keys: Tensor
    scale: float


def window_inputs(
    query: Tensor,
    w_q: Tensor,
    keys: Tensor,
    visible: Optional[Tensor],
    real: Optional[Tensor],
    segment_bounds: Optional[Tuple[Tensor, Tensor]],
) -> WindowInputs:
    """:class:`WindowInputs` from the visible keys as :meth:`DynamicWindow.visible_keys` gives
    them and the segment bounds as :func:`segment_bounds` does (or None)."""
    if visible is not None:
        visible = visible.view(*([1] * (4 - visible.dim())), *visible.shape)
    start, end = segment_bounds if segment_bounds is not None else (None, None)
    return WindowInputs(query, w_q, keys, visible, real, start, end)


def dynamic_window_mask(window: WindowInputs) -> Tuple[Tensor, Tensor]:
    """The mask M (B, H, T, S) and the pointers phi_l above phi_r (B, 2H, T, S, detached)."""
    return torch.ops.local_attn.dynamic_window_mask(*window)


def additive_window_term(window: WindowInputs, local: LocalScoreInputs) -> Tuple[Tensor, Tensor]:
    """The additive window's term s_loc * M of every head, (B, H, T, S), and the pointers as
    :func:`dynamic_window_mask` gives them."""
    return torch.ops.local_attn.additive_window_term(*window, *local)


class AttentionInputs(NamedTuple):
    """What the attention operators read besides q, k, v and the mechanisms' terms: attn_mask
    (T, S) additive or None; key_padding_mask (B, S) bool, True for padding, or None;
    dropout_keep (B, H, T, S) bool or None, kept weights scaled by 1 / (1 - dropout_p); the
    logits' scale."""

    attn_mask: Optional[Tensor]
    key_padding_mask: Optional[Tensor]
    dropout_keep: Optional[Tensor]
    scale: float
    dropout_p: float


def gaussian_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gaussian: GaussianInputs,
    bias: Optional[Tensor],
    multiplier: Optional[Tensor],
    attention: AttentionInputs,
) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`dense_attention` with the Gaussian bias G of ``gaussian`` added to ``bias`` (or
    alone), in one call; with the centres P and the windows D (B, H, T), detached."""
    return torch.ops.local_attn.gaussian_attention(
        q, k, v, *gaussian, bias, multiplier, *attention
    )


def window_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: WindowInputs,
    local: Optional[LocalScoreInputs],
    bias: Optional[Tensor],
    multiplier: Optional[Tensor],
    attention: AttentionInputs,
) -> Tuple[Tensor, Tensor]:
    """:func:`dense_attention` with the window's mask M among its multipliers (MW), or, given
    ``local``, the additive window's term s_loc * M among its additive terms (AW), in one call;
    with the pointers as :func:`dynamic_window_mask` gives them."""
    local_w, local_b, local_keys, local_scale = local or (None, None, None, 0.0)
    return torch.ops.local_attn.window_attention(
        q, k, v, *window, local_w, local_b, local_keys, local_scale, bias, multiplier, *attention
    )


def dense_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Optional[Tensor],
    multiplier: Optional[Tensor],
    attention: AttentionInputs,
) -> Tensor:
    """(softmax(scale q k^T + bias + attn_mask, padded keys excluded) * multiplier, dropped out)
    v, (B, H, T, D): q (B, H, T, D), k and v (B, H, S, D); bias and multiplier (B, H, T, S) or
    None. A query without a key gets zeros."""
    return torch.ops.local_attn.dense_attention(q, k, v, bias, multiplier, *attention)


# ---------------------------------------------------------------------------------------------
# Fake kernels (torch.compile, torch.export, opcheck): the operators' output shapes, and those of
# their ``<name>_backward`` companions (csrc/operator_autograd.h), which give one gradient per
# argument, an empty tensor where the argument takes none. Autograd stays in C++.


def _fake_gaussian_localness(query, w_p, u_p, u_d, span, length, positions, *rest):
    bsz, tgt_len, _ = query.shape
    per_query = (bsz, u_p.shape[0], tgt_len)
    bias = query.new_empty((*per_query, positions.shape[1]))
    return bias, query.new_empty(per_query), query.new_empty(per_query)


def _fake_window_mask(query, w_q, keys, *rest):
    """dynamic_window_mask's (M, pointers) and additive_window_term's (term, pointers)."""
    bsz, tgt_len, _ = query.shape
    pointers, src_len = keys.shape[1], keys.shape[2]
    pointer_shape = (bsz, pointers, tgt_len, src_len)
    return query.new_empty((bsz, pointers // 2, tgt_len, src_len)), query.new_empty(pointer_shape)


def _fake_dense_attention(q, k, v, *rest):
    return q.new_empty((*q.shape[:3], v.shape[3]))


def _fake_gaussian_attention(q, k, v, *rest):
    per_query = q.shape[:3]
    return _fake_dense_attention(q, k, v), q.new_empty(per_query), q.new_empty(per_query)


def _fake_window_attention(q, k, v, query, w_q, keys, *rest):
    pointer_shape = (q.shape[0], keys.shape[1], q.shape[2], keys.shape[2])
    return _fake_dense_attention(q, k, v), q.new_empty(pointer_shape)


# Each operator's fake kernel and the argument positions that take gradients (the Autograd
# kernels' in csrc/mechanisms_cpu.cpp).
_FAKE_KERNELS = {
    "gaussian_localness": (_fake_gaussian_localness, (0, 1, 2, 3, 7, 8)),
    "dynamic_window_mask": (_fake_window_mask, (0, 1, 2)),
    "additive_window_term": (_fake_window_mask, (0, 1, 2, 7, 8, 9)),
    "dense_attention": (_fake_dense_attention, (0, 1, 2, 3, 4)),
    "gaussian_attention": (_fake_gaussian_attention, (0, 1, 2, 3, 4, 5, 6, 10, 13, 14)),
    "window_attention": (_fake_window_attention, (0, 1, 2, 3, 4, 5, 10, 11, 12, 14, 15)),
}


def _fake_gradients(differentiable: Tuple[int, ...]):
    def fake_backward(grad, *args):
        return [
            arg.new_empty(arg.shape) if i in differentiable and arg is not None else
            grad.new_empty(0)
            for i, arg in enumerate(args)
        ]  # fmt: skip

    return fake_backward


_FAKES_REGISTERED: set = set()


def register_fake_kernels() -> None:
    """Register the fake kernels of the operators the loaded extension defines (once each)."""
    for name, (forward, differentiable) in _FAKE_KERNELS.items():
        if name in _FAKES_REGISTERED or not _op_defined(f"{name}_backward"):
            continue
        torch.library.register_fake(f"local_attn::{name}", forward)
        torch.library.register_fake(f"local_attn::{name}_backward", _fake_gradients(differentiable))
        _FAKES_REGISTERED.add(name)


# torch imports this module for the fake kernels when the library was loaded some other way.
register_fake_kernels()
