"""Banded (local) self-attention without a T x T matrix: the public API and its dispatch.

``banded_attention`` validates its arguments, draws the dropout mask, and runs one of four
routes with the same semantics:

* ``extension``: the compiled operators ``torch.ops.local_attn.banded_forward`` /
  ``banded_backward`` (C++ on the CPU, CUDA-core kernels on the GPU; csrc/);
* ``tensor-core``: ``banded_forward_tensor_core`` / ``banded_backward_tensor_core``, the
  band-restricted flash attention for float16/bfloat16 on sm_80+ GPUs (same schema);
* ``sdpa``: ``blocked_sdpa``, PyTorch's ``scaled_dot_product_attention`` over blocks of queries
  with the exact band as a mask (dropout_p = 0 only);
* ``torch``: ``banded_reference``, plain PyTorch, on any device.

``LOCAL_ATTN_BANDED_IMPL`` picks one (``auto``, the default, is the rule of ``choose_route``).
The extension is imported lazily on first use; importing the plugin never requires it.
"""

import functools
import importlib
import math
import operator
import warnings
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F

from . import banded_reference, measured_routes, route_table
from .blocked_sdpa import blocked_sdpa_output
from .second_derivatives import gradients_with_graph
from .environment import environment_value

IMPL_ENV = "LOCAL_ATTN_BANDED_IMPL"
ROUTES = ("auto", "extension", "torch", "sdpa", "tensor-core", "flash-window", "cudnn-band")
EXTENSION_MODULE = "local_attn_fairseq._banded_C"
BUILD_HINT = (
    "build it with `pip install --no-build-isolation -e .` (or `make setup`) in the "
    "local_attn_fairseq repository"
)

Window = Union[int, Sequence[int], torch.Tensor, np.ndarray]


class _ExtensionState:
    """What the lazy import of the compiled extension found (loaded once per process)."""

    attempted = False
    module = None
    error: Optional[BaseException] = None
    warned: set = set()
    all_finite = None  # the extension's CPU finiteness test (an older build has none)


def _op_defined(name: str) -> bool:
    return hasattr(torch.ops, "local_attn") and hasattr(torch.ops.local_attn, name)


def load_extension():
    """The compiled extension module, or None when it cannot be imported (the reason is kept)."""
    state = _ExtensionState
    if not state.attempted:
        state.attempted = True
        try:
            state.module = importlib.import_module(EXTENSION_MODULE)
            state.all_finite = getattr(state.module, "all_finite", None)
            _register_python_parts()
        except (ImportError, OSError) as error:  # not built, or built against another torch
            state.error = error
    return state.module


def _built_with_tensor_core(module) -> bool:
    # An extension built before the tensor-core kernel existed has no such function.
    built = getattr(module, "built_with_tensor_core", None)
    return bool(built and built()) and _op_defined("banded_forward_tensor_core")


def extension_info() -> dict:
    """Whether the extension is loaded, which CPU kernel copy it runs, whether it has CUDA
    kernels and the tensor-core kernel."""
    module = load_extension()
    if module is None:
        return {"loaded": False, "error": str(_ExtensionState.error)}
    return {
        "loaded": True,
        "cpu_isa": module.cpu_isa(),
        "cuda": module.built_with_cuda(),
        "tensor_core": _built_with_tensor_core(module),
    }


def _warn_once(key: str, message: str) -> None:
    if key not in _ExtensionState.warned:
        _ExtensionState.warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


# ---------------------------------------------------------------------------------------------
# Dispatch. What each route takes is declared in ops/route_table.py; which route ``auto`` takes
# on a GPU comes from the committed GPU records (ops/measured_routes.py) where they decide the
# call's cell, and from DEFAULT_GPU_PREFERENCES elsewhere.

CUDA_MAX_HEAD_DIM = route_table.ROUTE_TABLE["extension"].head_dims.cuda_max
LIBRARY_ROUTES = route_table.LIBRARY_ROUTES


@dataclass(frozen=True)
class GpuPreference:
    """A route that was measured faster on a GPU than the CUDA-core kernels, for the calls it
    covers: these dtypes and head dims, band widths (max left + max right + 1, clipped to the
    sequence) in [min_width, max_width]."""

    route: str
    dtypes: Tuple[torch.dtype, ...]
    head_dims: Tuple[int, ...]
    min_width: int
    max_width: int
    measured: str  # GPU, torch version, date: the table in docs/banded_attention.md

    def covers(self, dtype, head_dim, width) -> bool:
        return (
            dtype in self.dtypes
            and head_dim in self.head_dims
            and self.min_width <= width <= self.max_width
        )


# What ``auto`` prefers on a GPU over the CUDA-core kernels in a cell that no committed record
# decides, first match first, for calls the route can take (dropout included: the tensor-core
# kernel applies the operator's keep-mask). Set after the first H200 run, whose float16 and
# w = 5 cells are tables in docs/banded_attention.md rather than committed records: the
# tensor-core kernel passed its CUDA tests and was faster than the CUDA-core kernels in every
# such cell, forward + backward (1.1x at w = 5 to 17x at w = 1025); blocked SDPA was slower
# than the tensor-core kernel in every cell, so it has no entry.
_H200 = "NVIDIA H200, torch 2.11.0+cu130, 2026-11-26"
DEFAULT_GPU_PREFERENCES: Tuple[GpuPreference, ...] = (
    GpuPreference("tensor-core", (torch.bfloat16,), (64,), 5, 1025, _H200),
    GpuPreference("tensor-core", (torch.float16,), (64,), 5, 257, _H200),
    GpuPreference("tensor-core", (torch.bfloat16,), (32, 128), 33, 257, _H200),
)


def _measured_cells(cells) -> dict:
    """(dtype, head dim, T, w) -> the route the committed records show fastest there."""
    return {(getattr(torch, d), dim, t, w): r for (d, dim, t, w), r in cells.items() if r}


MEASURED_ROUTES = _measured_cells(measured_routes.CELLS)


def requested_route() -> str:
    """The value of LOCAL_ATTN_BANDED_IMPL, checked."""
    choice = environment_value(IMPL_ENV) or "auto"
    if choice not in ROUTES:
        raise ValueError(
            f"{IMPL_ENV}={choice!r} is not a route of banded_attention: use one of "
            f"{', '.join(ROUTES)} (see docs/banded_attention.md)"
        )
    return choice


# LOCAL_ATTN_BANDED_IMPL values under which the compiled kernels take every CPU call (unset or
# empty is auto)
_CPU_KERNEL_CHOICES = (None, "", "auto", "extension")


def _cpu_kernels_take(is_cpu: bool) -> bool:
    """Whether a call goes to the compiled CPU kernels: they take every CPU call under ``auto``
    and ``extension``. Asked first, as every call asks, without building a device object."""
    return (
        is_cpu
        and _ExtensionState.module is not None
        and environment_value(IMPL_ENV) in _CPU_KERNEL_CHOICES
    )


def _extension_has_device(module, device: torch.device, head_dim: int) -> bool:
    if device.type == "cuda":
        return module.built_with_cuda() and head_dim <= CUDA_MAX_HEAD_DIM
    return device.type == "cpu"


def _loaded_or_warn():
    module = load_extension()
    if module is None:
        _warn_once(
            "missing",
            f"local_attn_fairseq: the banded attention extension is not built "
            f"({_ExtensionState.error}); using the slower pure-PyTorch implementation. "
            f"To use the C++/CUDA kernels, {BUILD_HINT}.",
        )
    return module


def _required_extension(device: torch.device, head_dim: int) -> str:
    module = load_extension()
    if module is None:
        raise RuntimeError(
            f"{IMPL_ENV}=extension but the banded attention extension cannot be imported "
            f"({_ExtensionState.error}); {BUILD_HINT}"
        )
    if not _extension_has_device(module, device, head_dim):
        raise RuntimeError(
            f"{IMPL_ENV}=extension: the banded attention extension has no kernel for "
            f"{device.type} inputs of head dim {head_dim}"
        )
    return "extension"


def _availability_reasons(route: str, device: torch.device) -> List[str]:
    """Why ``route`` is missing here whatever the call: not built, or not importable."""
    if route in ("extension", "tensor-core"):
        module = load_extension()
        if module is None:
            error = route_table.first_line(_ExtensionState.error)
            return [f"the extension is not built ({error})"]
        if route == "tensor-core" and not _built_with_tensor_core(module):
            return ["the extension was built without the tensor-core kernel"]
        if device.type == "cuda" and not module.built_with_cuda():
            return ["the extension was built without its CUDA kernels"]
        return []
    return route_table.library_reasons(route)


def _call_needs(dropout_p: float) -> Tuple[str, ...]:
    return ("dropout",) if dropout_p else ()


def _route_reasons(route, device, dtype, head_dim, dropout_p) -> List[str]:
    """Why ``route`` cannot take a self-attention call of these inputs here (no tensors
    needed: what the table declares and what is built or importable)."""
    reasons = route_table.declared_reasons(route, device, dtype, head_dim, _call_needs(dropout_p))
    return reasons + _availability_reasons(route, device)


def _per_head(window: Window, heads: int) -> List[int]:
    """One int per head, negative ones kept (they are a reason, not an error, here)."""
    if isinstance(window, (torch.Tensor, np.ndarray)) and window.ndim > 0:
        return [operator.index(w) for w in window.tolist()]
    if isinstance(window, SequenceABC):
        return [operator.index(w) for w in window]
    return [operator.index(window)] * heads


def unsupported_reasons(
    route: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    left: Window,
    right: Window,
    key_padding_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
) -> List[str]:
    """Why ``route`` cannot take this call here, in words (empty: it can): what the route table
    declares against it, what is not built or importable, and, for a library route the table
    allows, what its adapter's ``unsupported_reasons`` says. q (B, H, Tq, D), k and v
    (B, H, Tk, D); left and right an int or one per head."""
    lefts, rights = _per_head(left, q.shape[1]), _per_head(right, q.shape[1])
    needs = list(_call_needs(dropout_p))
    if min(lefts + rights, default=0) < 0:
        needs.append("query_excluding_bounds")
    if q.shape[2] != k.shape[2]:
        needs.append("unequal_lengths")
    if key_padding_mask is not None:
        needs.append("padding")
    if len(set(zip(lefts, rights))) > 1:
        needs.append("per_head_windows")
    reasons = route_table.declared_reasons(route, q.device, q.dtype, q.shape[-1], needs)
    reasons += _availability_reasons(route, q.device)
    if not reasons and route in LIBRARY_ROUTES:
        reasons = route_table.adapter_reasons(
            route, q, k, v, lefts, rights, key_padding_mask, dropout_p
        )
    return reasons


def tensor_core_gap(device: torch.device, dtype: torch.dtype, head_dim: int) -> Optional[str]:
    """Why the tensor-core kernel cannot take these inputs, or None when it can."""
    reasons = route_table.declared_reasons("tensor-core", device, dtype, head_dim)
    return reasons[0] if reasons else None


def _serves(route, device, dtype, head_dim, dropout_p) -> bool:
    return not _route_reasons(route, device, dtype, head_dim, dropout_p)


def _automatic_route(device, dtype, head_dim, width, dropout_p, length) -> str:
    if device.type == "cuda":
        measured = MEASURED_ROUTES.get((dtype, head_dim, length, width))
        if measured is not None and _serves(measured, device, dtype, head_dim, dropout_p):
            return measured
        for preference in DEFAULT_GPU_PREFERENCES:
            if preference.covers(dtype, head_dim, width) and _serves(
                preference.route, device, dtype, head_dim, dropout_p
            ):
                return preference.route
    module = _loaded_or_warn()
    if module is None:
        return "torch"
    if _extension_has_device(module, device, head_dim):
        return "extension"
    _warn_once(
        f"{device.type}/{head_dim}",
        f"local_attn_fairseq: the banded attention extension has no kernel for {device.type} "
        f"inputs of head dim {head_dim}; using the pure-PyTorch implementation (CUDA needs "
        f"nvcc at build time and head dim <= {CUDA_MAX_HEAD_DIM}).",
    )
    return "torch"


def choose_route(
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    head_dim: int = 0,
    width: int = 1,
    dropout_p: float = 0.0,
    length: Optional[int] = None,
) -> str:
    """The route a call of sequence length ``length`` runs (see docs/banded_attention.md,
    "Routes and dispatch"; the routes are the keys of ``route_table.ROUTE_TABLE``).

    ``auto``: on the CPU the compiled kernels (PyTorch with a one-time warning when they are
    not built); on a GPU the route the committed records show fastest in the call's (dtype,
    head dim, T, w) cell (``MEASURED_ROUTES``), where they decide it and the route can take
    the call, else the first entry of ``DEFAULT_GPU_PREFERENCES`` that covers the call, else
    the CUDA-core kernels, else PyTorch. A route that no GPU has run is never chosen.

    Asked for by name, a route that cannot take a call is refused with a RuntimeError of one
    line that names what it lacks, except the two fallbacks the docs promise: ``sdpa`` sends
    calls with dropout, and ``tensor-core`` inputs it does not take (devices, dtypes, head
    dims, older GPUs), to the ``auto`` route, with a warning once. ``extension`` fails where
    it has no kernel.
    """
    if _cpu_kernels_take(device.type == "cpu"):
        return "extension"
    choice = requested_route()
    if choice == "auto":
        return _automatic_route(device, dtype, head_dim, width, dropout_p, length)
    if choice == "torch":
        return "torch"
    if choice == "extension":
        return _required_extension(device, head_dim)
    missing = _availability_reasons(choice, device) if choice == "tensor-core" else None
    if missing:
        hint = f"it is built with the CUDA kernels where nvcc is found: {BUILD_HINT}"
        raise RuntimeError(route_table.refusal(IMPL_ENV, choice, missing, hint))
    reasons = _route_reasons(choice, device, dtype, head_dim, dropout_p)
    if not reasons:
        return choice
    if choice == "sdpa":
        _warn_once(
            "sdpa/dropout",
            f"local_attn_fairseq: {IMPL_ENV}=sdpa cannot apply the operator's dropout mask; "
            "calls with dropout_p > 0 take the automatic route.",
        )
    elif choice == "tensor-core":
        gap = "; ".join(reasons)
        _warn_once(
            f"tensor-core/{gap}",
            f"local_attn_fairseq: {IMPL_ENV}=tensor-core, but {gap}; those calls take the "
            "automatic route.",
        )
    else:
        raise RuntimeError(route_table.refusal(IMPL_ENV, choice, reasons))
    return _automatic_route(device, dtype, head_dim, width, dropout_p, length)


@dataclass(frozen=True)
class BandCapabilities:
    """What the attention module may rely on for a band of given inputs: the route
    ``banded_attention`` takes for them, that route's declaration in the route table, and
    every route that could take them here."""

    route: str
    support: route_table.RouteSupport
    usable: Tuple[str, ...]

    def supports(self, feature: str) -> bool:
        """Whether the route taken declares ``feature`` (a name of ``route_table.FEATURES``)."""
        return self.support.supports(feature)


def band_capabilities(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    width: int = 1,
    dropout_p: float = 0.0,
    length: Optional[int] = None,
) -> BandCapabilities:
    """The route table's answer for a band of these inputs (see ``BandCapabilities``)."""
    route = choose_route(device, dtype, head_dim, width, dropout_p, length)
    usable = tuple(
        name
        for name in route_table.ROUTE_TABLE
        if _serves(name, device, dtype, head_dim, dropout_p)
    )
    return BandCapabilities(route, route_table.route_support(route), usable)


def use_extension(device: torch.device, head_dim: int = 0) -> bool:
    """Whether ``choose_route`` gives such inputs to the compiled ``banded_forward`` /
    ``banded_backward`` (for callers that need that (out, lse) pair, else ``banded_reference``)."""
    return choose_route(device, head_dim=head_dim) == "extension"


# ---------------------------------------------------------------------------------------------
# Fake kernels of the compiled operators (registered when the extension loads). Their autograd
# is C++ (csrc/banded_attention_autograd.cpp), registered for the Autograd key with the kernels.


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return banded_reference.compute_dtype(dtype)


def _fake_forward(q, k, v, left, right, key_padding_mask, dropout_keep, scale, dropout_p):
    batch, heads, length, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, length), dtype=_lse_dtype(q.dtype))


def _fake_backward(grad_out, q, k, v, out, lse, left, right, *masks_and_floats):
    return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape)


# (forward, backward) operator pairs with the schema of local_attn::banded_forward/backward.
OPERATOR_PAIRS = (
    ("banded_forward", "banded_backward"),
    ("banded_forward_tensor_core", "banded_backward_tensor_core"),
)
_REGISTERED: set = set()


def register_operator_pair(forward: str, backward: str) -> bool:
    """Fake kernels (for torch.compile / opcheck) of one operator pair; False when the loaded
    library does not define it (an extension built before the pair existed)."""
    if forward in _REGISTERED:
        return True
    if not (_op_defined(forward) and _op_defined(backward)):
        return False
    torch.library.register_fake(f"local_attn::{forward}", _fake_forward)
    torch.library.register_fake(f"local_attn::{backward}", _fake_backward)
    _REGISTERED.add(forward)
    return True


def _register_python_parts() -> None:
    for forward, backward in OPERATOR_PAIRS:
        register_operator_pair(forward, backward)


# torch imports this module for the fake kernels when the library was loaded some other way.
_register_python_parts()


class _TorchBandedAttention(torch.autograd.Function):
    """The pure-PyTorch fallback, with the same saved state and backward as the operators, and
    second derivatives (ops/second_derivatives.py). Forward and ``setup_context`` apart, as
    torch.func's transforms need: ``torch.func.grad`` and ``vjp`` differentiate it."""

    @staticmethod
    def forward(q, k, v, left, right, key_padding_mask, dropout_keep, scale, dropout_p):
        return banded_reference.banded_forward(
            q, k, v, left, right, key_padding_mask, dropout_keep, scale, dropout_p
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, left, right, key_padding_mask, dropout_keep, scale, dropout_p = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, dropout_keep)
        ctx.band = (left, right, scale, dropout_p)
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, key_padding_mask, dropout_keep = ctx.saved_tensors
        left, right, scale, dropout_p = ctx.band
        if torch.is_grad_enabled():  # create_graph: differentiable gradients
            band = (left, right, key_padding_mask, dropout_keep, scale, dropout_p)
            dq, dk, dv = gradients_with_graph(
                lambda q, k, v: banded_reference.banded_forward(q, k, v, *band)[0],
                (q, k, v), grad_out,
            )  # fmt: skip
            return dq, dk, dv, None, None, None, None, None, None
        dq, dk, dv = banded_reference.banded_backward(
            grad_out, q, k, v, out, lse, left, right, key_padding_mask, dropout_keep, scale,
            dropout_p,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# Validation.


def _check_qkv(q, k, v) -> None:
    try:  # the common case in a few comparisons; the messages below name what is wrong
        if (
            q.dim() == 4
            and q.shape == k.shape == v.shape
            and q.dtype == k.dtype == v.dtype
            and q.dtype.is_floating_point
            and q.device == k.device == v.device
            and isinstance(q, torch.Tensor)
            and isinstance(k, torch.Tensor)
            and isinstance(v, torch.Tensor)
        ):
            return
    except (AttributeError, TypeError):
        pass
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"banded_attention: {name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"banded_attention: {name} must be 4-D (batch, heads, length, head_dim), "
                f"got shape {tuple(t.shape)}"
            )
    if not (q.shape == k.shape == v.shape):
        raise ValueError(
            "banded_attention: q, k and v must have the same shape (self-attention), got "
            f"{tuple(q.shape)}, {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ValueError(
            "banded_attention: q, k and v must share one floating point dtype, got "
            f"{q.dtype}, {k.dtype} and {v.dtype}"
        )
    raise ValueError("banded_attention: q, k and v must be on the same device")


def _window_value(value, name: str) -> int:
    """One window as an int: any integer type (int, numpy or 0-d torch integers), not a float
    (a computed float window would be truncated silently) nor a bool."""
    if isinstance(value, (bool, np.bool_)) or (
        isinstance(value, torch.Tensor) and value.dtype == torch.bool
    ):
        raise ValueError(f"banded_attention: {name} must be an int, got a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(
            f"banded_attention: {name} must be an int, a sequence of per-head ints or an "
            f"integer tensor, got {type(value).__name__} {value!r} (round a computed window "
            "with int() first)"
        ) from None


def _window_list(window: Window, heads: int, name: str) -> List[int]:
    """One non-negative window per head, from an int, a sequence, or an (H,) integer tensor
    or numpy array."""
    if isinstance(window, (torch.Tensor, np.ndarray)):
        if isinstance(window, torch.Tensor):
            integer = not (window.is_floating_point() or window.is_complex()) and (
                window.dtype != torch.bool
            )
        else:
            integer = window.dtype.kind in "iu"
        if not integer:
            raise ValueError(f"banded_attention: {name} must hold integers, got {window.dtype}")
        if window.ndim > 1:
            raise ValueError(f"banded_attention: {name} must be an int or a 1-D (heads,) tensor")
        window = window.tolist()
    if type(window) is int:
        values = [window] * heads
    elif type(window) in (list, tuple) and all(type(w) is int for w in window):
        values = list(window)  # the common case (plain ints), checked without a call per head
    elif isinstance(window, SequenceABC) and not isinstance(window, str):
        values = [_window_value(w, name) for w in window]
    else:
        values = [_window_value(window, name)] * heads
    if len(values) != heads:
        raise ValueError(
            f"banded_attention: {name} gives {len(values)} per-head windows for {heads} heads"
        )
    if any(w < 0 for w in values):
        raise ValueError(f"banded_attention: {name} windows must be >= 0, got {values}")
    return values


def _plain_windows(window) -> bool:
    """An int, or a list or tuple of ints: windows that can key the cache of clipped bands
    (exact ints only: True == 1 would share an entry with 1 and skip its refusal)."""
    if type(window) is int:
        return True
    return type(window) in (list, tuple) and all(type(w) is int for w in window)


def clipped_band(left: Window, right: Window, heads: int, length: int):
    """Checked per-head windows clipped to the sequence, and the band's width.

    Keys beyond the sequence are never allowed, so windows longer than T - 1 change nothing but
    the band's size: everything works on the clipped band. Returns (left, right) as tuples of
    ints and W = max(left) + max(right) + 1; worked out once per windows and sizes.
    """
    if _plain_windows(left) and _plain_windows(right):
        plain = [w if type(w) is int else tuple(w) for w in (left, right)]
        return _clipped_band(*plain, heads, length)
    return _clip_band(left, right, heads, length)


def _clip_band(left, right, heads: int, length: int):
    lefts, rights = _window_list(left, heads, "left"), _window_list(right, heads, "right")
    reach = max(length - 1, 0)
    band_left = tuple(min(w, reach) for w in lefts)
    band_right = tuple(min(w, reach) for w in rights)
    return band_left, band_right, max(band_left, default=0) + max(band_right, default=0) + 1


_clipped_band = functools.lru_cache(maxsize=256)(_clip_band)


def _check_padding(mask: Optional[torch.Tensor], q: torch.Tensor) -> Optional[torch.Tensor]:
    if mask is None:
        return None
    batch, _, length, _ = q.shape
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (batch, length):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"banded_attention: key_padding_mask must be (batch, length) = {(batch, length)}, "
            f"got {shape}"
        )
    if mask.dtype.is_floating_point:
        raise ValueError(
            f"banded_attention: key_padding_mask must be bool (True = padding), got {mask.dtype}"
        )
    if mask.device != q.device:
        raise ValueError(
            f"banded_attention: key_padding_mask is on {mask.device} but q is on {q.device}"
        )
    return mask.bool()


def _check_dropout(dropout_p: float) -> float:
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"banded_attention: dropout_p must be in [0, 1], got {dropout_p}")
    return dropout_p


# ---------------------------------------------------------------------------------------------
# The API.


def draw_dropout_keep(
    shape: Tuple[int, int, int, int], dropout_p: float, device: torch.device
) -> Optional[torch.Tensor]:
    """The dropout keep-mask in band layout (B, H, T, W), True = kept; None when p == 0.

    Drawn from torch's global generator, so ``torch.manual_seed`` makes it reproducible.
    """
    if dropout_p == 0.0:
        return None
    return torch.rand(shape, device=device) >= dropout_p


def _all_finite(v: torch.Tensor) -> bool:
    """Whether v holds only finite values. On the CPU the extension reads v in place; else one
    reduction and one scalar read (torch.isfinite is several operations on the CPU, and on a
    GPU either form waits for the device once)."""
    in_place = _ExtensionState.all_finite
    if in_place is not None and v.is_cpu and not torch.compiler.is_compiling():
        return in_place(v)
    return math.isfinite(v.sum(dtype=banded_reference.compute_dtype(v.dtype)).item())


def nonfinite_value_reach(
    v: torch.Tensor,
    left: Sequence[int],
    right: Sequence[int],
    key_padding_mask: Optional[torch.Tensor],
) -> torch.Tensor:
    """Where the non-finite entries of v (a v that holds some: see ``_all_finite``) reach the
    output.

    Entry (b, h, i, d) of the (B, H, T, D) bool result is True when query i may attend to a
    key j (inside its window and the sequence, not padding) whose value v[b, h, j, d] is NaN or
    +-inf: a sum over the allowed keys would be non-finite there. Counted with prefix sums
    along T, so no (T, w) tensor is formed.
    """
    batch, heads, length, dim = v.shape
    bad = ~torch.isfinite(v)
    if key_padding_mask is not None:
        bad = bad & ~key_padding_mask[:, None, :, None]
    before = F.pad(bad.to(torch.int32).cumsum(2), (0, 0, 1, 0))  # bad keys before position t
    position = torch.arange(length, device=v.device)
    lefts = torch.tensor(list(left), device=v.device)[:, None]
    rights = torch.tensor(list(right), device=v.device)[:, None]
    first = (position - lefts).clamp(min=0)  # (H, T)
    end = (position + rights).clamp(max=length - 1) + 1

    def at(index):
        return before.gather(2, index[None, :, :, None].expand(batch, heads, length, dim))

    return at(end) > at(first)


def banded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    left: Window,
    right: Window,
    key_padding_mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
):
    """Self-attention of each query over the keys of its window, renormalised inside the window.

    Args:
        q, k, v: (B, H, T, D) tensors of one floating dtype (float32, float64, bfloat16, float16).
        left, right: window sizes, an int for every head or one per head (a sequence, or an (H,)
            integer tensor or numpy array). Integers of any type; floats are refused. Query i of
            head h attends to keys i - left[h] .. i + right[h] that lie in the sequence and are
            not padding (raw positions: a caller with left-padded sentences shifts nothing,
            padding is removed through ``key_padding_mask``).
        key_padding_mask: optional (B, T) bool, True = padded key.
        scale: logit scale, default D ** -0.5.
        dropout_p: dropout on the attention weights (pass 0 at evaluation, as fairseq does).
        return_weights: also return the (pre-dropout) weights in band layout.

    Returns:
        out (B, H, T, D) in q's dtype; with ``return_weights`` also weights (B, H, T, W) in q's
        dtype, W = L + R + 1 with L = min(max(left), T - 1) and R = min(max(right), T - 1),
        column c holding key i - L + c (zero where that key is not allowed). A query with no
        allowed key gets zeros, and zero gradients. A NaN or inf in v[..., j, d] makes
        out[..., i, d] NaN for exactly the queries i that may attend to key j.
    """
    _check_qkv(q, k, v)
    batch, heads, length, dim = q.shape
    band_left, band_right, width = clipped_band(left, right, heads, length)
    if key_padding_mask is not None:
        key_padding_mask = _check_padding(key_padding_mask, q)
    dropout_p = 0.0 if dropout_p == 0 else _check_dropout(dropout_p)
    if q.numel() == 0:  # nothing to attend (no head, no position or no feature)
        out = q + k + v  # empty, but part of the graph: backward gives (empty) zero gradients
        return (out, q.new_zeros((batch, heads, length, width))) if return_weights else out
    scale = dim**-0.5 if scale is None else float(scale)
    if _cpu_kernels_take(q.is_cpu):
        route = "extension"
    else:
        route = choose_route(q.device, q.dtype, dim, width, dropout_p, length)
    nonfinite = None
    values = v
    if not _all_finite(v):
        nonfinite = nonfinite_value_reach(v, band_left, band_right, key_padding_mask)
        values = v.masked_fill(~torch.isfinite(v), 0)
    # the library routes draw their own dropout mask with their kernels' RNG
    keep_p = 0.0 if route in LIBRARY_ROUTES else dropout_p
    keep = draw_dropout_keep((batch, heads, length, width), keep_p, q.device)
    args = (q, k, values, band_left, band_right, key_padding_mask, keep, scale, dropout_p)
    out = _run_route(route, args)
    if nonfinite is not None:
        out = out.masked_fill(nonfinite, float("nan"))
    if not return_weights:
        return out
    weights, _ = banded_reference.band_probs(q, k, band_left, band_right, key_padding_mask, scale)
    return out, weights.to(q.dtype)


def _run_route(route: str, args) -> torch.Tensor:
    if route == "extension":
        return torch.ops.local_attn.banded_forward(*args)[0]
    if route == "tensor-core":
        return torch.ops.local_attn.banded_forward_tensor_core(*args)[0]
    if route == "sdpa":
        q, k, v, left, right, key_padding_mask, _, scale, _ = args
        return blocked_sdpa_output(q, k, v, left, right, key_padding_mask, scale)
    if route in LIBRARY_ROUTES:
        return _library_route_output(route, args)
    return _TorchBandedAttention.apply(*args)[0]


def _library_route_output(route: str, args) -> torch.Tensor:
    """A library route's output, after its adapter's own check of the call. The operator's
    keep-mask is not theirs to apply: the library draws its dropout mask with its own RNG."""
    q, k, v, left, right, key_padding_mask, _, scale, dropout_p = args
    reasons = route_table.adapter_reasons(route, q, k, v, left, right, key_padding_mask, dropout_p)
    if not reasons:
        attention = route_table.adapter_attention(route)
        return attention(q, k, v, left, right, key_padding_mask, scale, dropout_p)[0]
    if requested_route() == route:
        raise RuntimeError(route_table.refusal(IMPL_ENV, route, reasons))
    width = max(left) + max(right) + 1  # a measured cell the adapter refuses: the default rule
    fallback = _automatic_route(q.device, q.dtype, q.shape[-1], width, dropout_p, None)
    keep = draw_dropout_keep((*q.shape[:3], width), dropout_p, q.device)  # the operator's own
    return _run_route(fallback, (q, k, v, left, right, key_padding_mask, keep, scale, dropout_p))
