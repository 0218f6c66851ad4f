"""Banded (local) self-attention without a T x T matrix: the public API.

``banded_attention`` validates its arguments, draws the dropout mask, and runs either the
compiled operators ``torch.ops.local_attn.banded_forward`` / ``banded_backward`` (C++ on the CPU,
CUDA on the GPU; csrc/) or their pure-PyTorch twins in ``banded_reference``. The extension is
imported lazily on first use; importing the plugin never requires it.

Choose the implementation with ``LOCAL_ATTN_BANDED_IMPL``: ``auto`` (default: the extension when
it is built for the inputs' device, else PyTorch with a one-time warning), ``extension`` (fail if
it is missing) or ``torch``.
"""

import importlib
import os
import warnings
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from . import banded_reference

IMPL_ENV = "LOCAL_ATTN_BANDED_IMPL"
EXTENSION_MODULE = "local_attn_fairseq._banded_C"
BUILD_HINT = (
    "build it with `pip install --no-build-isolation -e .` (or `make setup`) in the "
    "local_attn_fairseq repository"
)

Window = Union[int, Sequence[int], torch.Tensor]


class _ExtensionState:
    """What the lazy import of the compiled extension found (loaded once per process)."""

    attempted = False
    module = None
    error: Optional[BaseException] = None
    warned: set = set()


def _op_defined() -> bool:
    return hasattr(torch.ops, "local_attn") and hasattr(torch.ops.local_attn, "banded_forward")


def load_extension():
    """The compiled extension module, or None when it cannot be imported (the reason is kept)."""
    state = _ExtensionState
    if not state.attempted:
        state.attempted = True
        try:
            state.module = importlib.import_module(EXTENSION_MODULE)
            _register_python_parts()
        except (ImportError, OSError) as error:  # not built, or built against another torch
            state.error = error
    return state.module


def extension_info() -> dict:
    """Whether the extension is loaded, which CPU kernel copy it runs, and whether it has CUDA."""
    module = load_extension()
    if module is None:
        return {"loaded": False, "error": str(_ExtensionState.error)}
    return {"loaded": True, "cpu_isa": module.cpu_isa(), "cuda": module.built_with_cuda()}


def _warn_once(key: str, message: str) -> None:
    if key not in _ExtensionState.warned:
        _ExtensionState.warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


CUDA_MAX_HEAD_DIM = 256  # the CUDA kernels keep a row's share of each lane in registers


def _extension_has_device(module, device: torch.device, head_dim: int) -> bool:
    if device.type == "cuda":
        return module.built_with_cuda() and head_dim <= CUDA_MAX_HEAD_DIM
    return device.type == "cpu"


def use_extension(device: torch.device, head_dim: int = 0) -> bool:
    """Whether inputs on `device` run the compiled kernels (see the module docstring)."""
    choice = os.environ.get(IMPL_ENV, "auto") or "auto"
    if choice not in ("auto", "extension", "torch"):
        raise ValueError(f"{IMPL_ENV} must be auto, extension or torch, got {choice!r}")
    if choice == "torch":
        return False
    module = load_extension()
    if module is None:
        if choice == "extension":
            raise RuntimeError(
                f"{IMPL_ENV}=extension but the banded attention extension cannot be imported "
                f"({_ExtensionState.error}); {BUILD_HINT}"
            )
        _warn_once(
            "missing",
            f"local_attn_fairseq: the banded attention extension is not built "
            f"({_ExtensionState.error}); using the slower pure-PyTorch implementation. "
            f"To use the C++/CUDA kernels, {BUILD_HINT}.",
        )
        return False
    if _extension_has_device(module, device, head_dim):
        return True
    what = f"{device.type} inputs of head dim {head_dim}"
    if choice == "extension":
        raise RuntimeError(f"the banded attention extension has no kernel for {what}")
    _warn_once(
        f"{device.type}/{head_dim}",
        f"local_attn_fairseq: the banded attention extension has no kernel for {what}; using "
        f"the pure-PyTorch implementation (CUDA needs nvcc at build time and head dim <= "
        f"{CUDA_MAX_HEAD_DIM}).",
    )
    return False


# ---------------------------------------------------------------------------------------------
# Fake kernels and autograd of the compiled operators (registered when the extension loads).


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return banded_reference.compute_dtype(dtype)


def _fake_forward(q, k, v, left, right, key_padding_mask, dropout_keep, scale, dropout_p):
    batch, heads, length, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, length), dtype=_lse_dtype(q.dtype))


def _fake_backward(grad_out, q, k, v, out, lse, left, right, *masks_and_floats):
    return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, left, right, key_padding_mask, dropout_keep, scale, dropout_p = inputs
    out, lse = output
    # Only q, k, v, out and the O(T) log-sum-exp (plus the masks given): the band is recomputed.
    ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, dropout_keep)
    ctx.band = (list(left), list(right), scale, dropout_p)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, key_padding_mask, dropout_keep = ctx.saved_tensors
    left, right, scale, dropout_p = ctx.band
    if grad_out is None:  # only the (non-differentiable) lse was used
        grad_out = torch.zeros_like(out)
    dq, dk, dv = torch.ops.local_attn.banded_backward(
        grad_out, q, k, v, out, lse, left, right, key_padding_mask, dropout_keep, scale, dropout_p
    )
    return dq, dk, dv, None, None, None, None, None, None


_REGISTERED = []


def _register_python_parts() -> None:
    """Fake kernels (for torch.compile / opcheck) and autograd of the compiled operators."""
    if _REGISTERED or not _op_defined():
        return
    torch.library.register_fake("local_attn::banded_forward", _fake_forward)
    torch.library.register_fake("local_attn::banded_backward", _fake_backward)
    torch.library.register_autograd(
        "local_attn::banded_forward", _backward, setup_context=_setup_context
    )
    _REGISTERED.append(True)


# torch imports this module for the fake kernels when the library was loaded some other way.
_register_python_parts()


class _TorchBandedAttention(torch.autograd.Function):
    """The pure-PyTorch fallback, with the same saved state and backward as the operators."""

    @staticmethod
    def forward(ctx, q, k, v, left, right, key_padding_mask, dropout_keep, scale, dropout_p):
        out, lse = banded_reference.banded_forward(
            q, k, v, left, right, key_padding_mask, dropout_keep, scale, dropout_p
        )
        ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, dropout_keep)
        ctx.band = (left, right, scale, dropout_p)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, key_padding_mask, dropout_keep = ctx.saved_tensors
        left, right, scale, dropout_p = ctx.band
        dq, dk, dv = banded_reference.banded_backward(
            grad_out, q, k, v, out, lse, left, right, key_padding_mask, dropout_keep, scale,
            dropout_p,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# Validation.


def _check_qkv(q, k, v) -> None:
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
    if not (q.device == k.device == v.device):
        raise ValueError("banded_attention: q, k and v must be on the same device")


def _window_list(window: Window, heads: int, name: str) -> List[int]:
    """One non-negative window per head, from an int, a sequence or an (H,) integer tensor."""
    if isinstance(window, torch.Tensor):
        if window.dtype.is_floating_point or window.dtype == torch.bool:
            raise ValueError(f"banded_attention: {name} must hold integers, got {window.dtype}")
        if window.dim() == 0:
            window = int(window)
        elif window.dim() != 1:
            raise ValueError(f"banded_attention: {name} must be an int or a 1-D (heads,) tensor")
        else:
            window = window.tolist()
    if isinstance(window, bool):
        raise ValueError(f"banded_attention: {name} must be an int, got a bool")
    values = [window] * heads if isinstance(window, int) else list(window)
    if len(values) != heads:
        raise ValueError(
            f"banded_attention: {name} gives {len(values)} per-head windows for {heads} heads"
        )
    if any(isinstance(w, bool) or not isinstance(w, int) for w in values):
        raise ValueError(f"banded_attention: {name} windows must be ints, got {values}")
    if any(w < 0 for w in values):
        raise ValueError(f"banded_attention: {name} windows must be >= 0, got {values}")
    return values


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
        left, right: window sizes, an int for every head or one per head (a sequence or an (H,)
            integer tensor). Query i of head h attends to keys i - left[h] .. i + right[h] that
            lie in the sequence and are not padding (raw positions: a caller with left-padded
            sentences shifts nothing, padding is removed through ``key_padding_mask``).
        key_padding_mask: optional (B, T) bool, True = padded key.
        scale: logit scale, default D ** -0.5.
        dropout_p: dropout on the attention weights (pass 0 at evaluation, as fairseq does).
        return_weights: also return the (pre-dropout) weights in band layout.

    Returns:
        out (B, H, T, D) in q's dtype; with ``return_weights`` also weights (B, H, T, W) in q's
        dtype, W = max(left) + max(right) + 1, column c holding key i - max(left) + c (zero
        where that key is not allowed). A query with no allowed key gets zeros, and zero
        gradients.
    """
    _check_qkv(q, k, v)
    batch, heads, length, dim = q.shape
    lefts, rights = _window_list(left, heads, "left"), _window_list(right, heads, "right")
    key_padding_mask = _check_padding(key_padding_mask, q)
    dropout_p = _check_dropout(dropout_p)
    if q.numel() == 0:  # nothing to attend (no head, no position or no feature)
        out = torch.zeros_like(q)
        width = max(lefts, default=0) + max(rights, default=0) + 1
        return (out, q.new_zeros((batch, heads, length, width))) if return_weights else out
    scale = dim**-0.5 if scale is None else float(scale)
    # Keys beyond the sequence are never allowed, so windows longer than T - 1 change nothing
    # but the band's size: the kernels work on the clipped band.
    reach = max(length - 1, 0)
    band_left, band_right = [min(w, reach) for w in lefts], [min(w, reach) for w in rights]
    width = max(band_left) + max(band_right) + 1
    keep = draw_dropout_keep((batch, heads, length, width), dropout_p, q.device)
    args = (q, k, v, band_left, band_right, key_padding_mask, keep, scale, dropout_p)
    if use_extension(q.device, dim):
        out, _ = torch.ops.local_attn.banded_forward(*args)
    else:
        out, _ = _TorchBandedAttention.apply(*args)
    if not return_weights:
        return out
    weights, _ = banded_reference.band_probs(q, k, band_left, band_right, key_padding_mask, scale)
    # Back to the band of the windows as given (columns past the sequence are zero).
    clipped = (max(lefts) - max(band_left), max(rights) - max(band_right))
    return out, F.pad(weights, clipped).to(q.dtype)
