"""The tensor-core banded attention operators against the pure-PyTorch reference.

``local_attn::banded_forward_tensor_core`` / ``banded_backward_tensor_core`` are called directly
and compared with ``banded_reference`` in float32 on the same (rounded) inputs. The CUDA tests
run where a GPU of compute capability 8.0 or newer is present and the extension was built with
the tensor-core kernels; the schema test runs wherever the extension is loaded.
"""

import importlib
from typing import List, NamedTuple, Optional

import pytest
import torch

from local_attn_fairseq.ops import banded_reference

banded_module = importlib.import_module("local_attn_fairseq.ops.banded_attention")
EXTENSION = banded_module.load_extension()


def _op_defined() -> bool:
    return hasattr(torch.ops, "local_attn") and hasattr(
        torch.ops.local_attn, "banded_forward_tensor_core"
    )


def _tensor_core_ready() -> bool:
    built = getattr(EXTENSION, "built_with_tensor_core", None)
    return (
        built is not None
        and built()
        and _op_defined()
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability() >= (8, 0)
    )


needs_op = pytest.mark.skipif(
    EXTENSION is None or not _op_defined(),
    reason="the loaded extension predates the tensor-core operators (or is not built)",
)
needs_tensor_core = pytest.mark.skipif(
    not _tensor_core_ready(),
    reason="needs the extension built with its tensor-core kernels and an sm_80+ CUDA device",
)

DTYPES = [torch.float16, torch.bfloat16]
HEAD_DIMS = [32, 64, 128]
# Against float32 on the same inputs: the kernels round P and dS to the input dtype for the
# tensor cores and the results to the output dtype.
TOLERANCE = {
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=4e-2, rtol=4e-2),
}
LSE_TOLERANCE = dict(atol=2e-3, rtol=2e-3)

# (batch, heads, length, left, right, padding kind, dropout_p)
CASES = {
    "symmetric": (2, 2, 200, 16, 16, "none", 0.0),
    "asymmetric": (2, 2, 150, 40, 3, "none", 0.0),
    "causal": (2, 2, 170, 33, 0, "none", 0.0),
    "per_head_windows": (2, 3, 160, [0, 7, 70], [5, 0, 20], "random", 0.0),
    "wider_than_length": (2, 2, 50, 100, 90, "none", 0.0),
    "length_not_a_tile_multiple": (1, 2, 131, 17, 9, "random", 0.0),
    "padding_with_empty_rows": (3, 2, 97, 2, 2, "empty_row", 0.0),
    "self_only": (2, 2, 70, 0, 0, "random", 0.0),
    "single_position": (2, 2, 1, 3, 3, "none", 0.0),
    "long_band": (1, 2, 1000, 64, 64, "random", 0.0),
    "dropout": (2, 3, 140, [5, 20, 0], [20, 3, 9], "random", 0.25),
    "dropout_wider_than_length": (2, 2, 40, [50, 3], [0, 60], "empty_row", 0.4),
    "many_heads": (1, 70, 40, [h % 9 for h in range(70)], [h % 4 for h in range(70)], "random",
                   0.0),
}  # fmt: skip


def per_head(window, heads):
    return list(window) if isinstance(window, list) else [window] * heads


def make_padding(kind, batch, length, gen):
    """(B, T) bool key padding: none, random, or random with one sentence all padding."""
    if kind == "none":
        return None
    mask = torch.rand(batch, length, generator=gen) < 0.25
    if kind == "empty_row":
        mask[-1] = True
    return mask


class Case(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad_out: torch.Tensor
    left: List[int]
    right: List[int]
    padding: Optional[torch.Tensor]
    keep: Optional[torch.Tensor]
    dropout_p: float

    def band_args(self, scale):
        return (self.left, self.right, self.padding, self.keep, scale, self.dropout_p)


def make_case(name, dtype, dim, seed=0) -> Case:
    """The inputs of one case on the GPU, in `dtype`."""
    batch, heads, length, left, right, padding_kind, dropout_p = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    q, k, v, grad_out = (torch.randn(batch, heads, length, dim, generator=gen) for _ in range(4))
    left, right = per_head(left, heads), per_head(right, heads)
    padding = make_padding(padding_kind, batch, length, gen)
    keep = None
    if dropout_p > 0:
        width = max(left) + max(right) + 1
        keep = torch.rand(batch, heads, length, width, generator=gen) >= dropout_p
    q, k, v, grad_out = (t.to("cuda", dtype) for t in (q, k, v, grad_out))
    padding, keep = (None if m is None else m.cuda() for m in (padding, keep))
    return Case(q, k, v, grad_out, left, right, padding, keep, dropout_p)


def tensor_core_forward(c: Case, scale, q=None):
    q = c.q if q is None else q
    return torch.ops.local_attn.banded_forward_tensor_core(q, c.k, c.v, *c.band_args(scale))


def tensor_core_backward(c: Case, out, lse, scale):
    return torch.ops.local_attn.banded_backward_tensor_core(
        c.grad_out, c.q, c.k, c.v, out, lse, *c.band_args(scale)
    )


def reference(c: Case, scale):
    """Output, lse and gradients of the float32 reference on the same rounded inputs."""
    q, k, v, grad_out = (t.float() for t in (c.q, c.k, c.v, c.grad_out))
    out, lse = banded_reference.banded_forward(q, k, v, *c.band_args(scale))
    grads = banded_reference.banded_backward(grad_out, q, k, v, out, lse, *c.band_args(scale))
    return out, lse, grads


def assert_close_to(got, want, dtype):
    assert got.dtype == dtype
    assert torch.isfinite(got).all(), "non-finite values"
    torch.testing.assert_close(got.float(), want, **TOLERANCE[dtype])


@needs_tensor_core
@pytest.mark.parametrize("name", CASES, ids=list(CASES))
@pytest.mark.parametrize("dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(name, dim, dtype):
    case, scale = make_case(name, dtype, dim), dim**-0.5
    out, lse = tensor_core_forward(case, scale)
    grads = tensor_core_backward(case, out, lse, scale)
    ref_out, ref_lse, ref_grads = reference(case, scale)
    assert lse.dtype == torch.float32 and lse.shape == case.q.shape[:3]
    torch.testing.assert_close(lse, ref_lse, **LSE_TOLERANCE)  # -inf where a row has no key
    assert_close_to(out, ref_out, dtype)
    for got, want in zip(grads, ref_grads):
        assert_close_to(got, want, dtype)


@needs_tensor_core
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_without_keys_give_zeros(dtype):
    case = make_case("padding_with_empty_rows", dtype, 64)
    out, lse = tensor_core_forward(case, 0.125)
    dq, dk, dv = tensor_core_backward(case, out, lse, 0.125)
    assert case.padding[-1].all()  # an all-padding sentence: every row of it is empty
    assert (out[-1] == 0).all() and torch.isneginf(lse[-1]).all()
    assert (dq[-1] == 0).all() and (dk[-1] == 0).all() and (dv[-1] == 0).all()
    # Padded keys of the other sentences get no gradient either.
    padded = case.padding[:-1, None, :, None].expand_as(dk[:-1])
    assert (dk[:-1][padded] == 0).all() and (dv[:-1][padded] == 0).all()


@needs_tensor_core
def test_backward_is_deterministic():
    case = make_case("dropout", torch.bfloat16, 64)
    out, lse = tensor_core_forward(case, 0.125)
    first, second = (tensor_core_backward(case, out, lse, 0.125) for _ in range(2))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@needs_tensor_core
def test_non_contiguous_and_unaligned_inputs():
    case = make_case("per_head_windows", torch.float16, 32)
    want_out, want_lse = tensor_core_forward(case, 0.2)
    # (B, T, H, D) storage seen as (B, H, T, D), and a copy starting 2 bytes into its storage.
    strided = case.q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous()
    shifted = torch.empty(case.q.numel() + 1, device="cuda", dtype=case.q.dtype)[1:]
    shifted = shifted.view(case.q.shape).copy_(case.q)
    assert shifted.data_ptr() % 16 != 0
    for q in (strided, shifted):
        out, lse = tensor_core_forward(case, 0.2, q=q)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@needs_tensor_core
def test_unsupported_inputs_are_refused_clearly():
    case = make_case("symmetric", torch.float16, 64)
    windows = ([2, 2], [2, 2], None, None, 0.1, 0.0)
    forward = torch.ops.local_attn.banded_forward_tensor_core
    with pytest.raises(RuntimeError, match="float16 and bfloat16"):
        forward(case.q.float(), case.k.float(), case.v.float(), *windows)
    narrow = [t[..., :48].contiguous() for t in (case.q, case.k, case.v)]
    with pytest.raises(RuntimeError, match="head dims 32, 64 and 128"):
        forward(*narrow, *windows)
    with pytest.raises(RuntimeError, match="one window per head"):
        forward(case.q, case.k, case.v, [2], [2], None, None, 0.1, 0.0)


@needs_op
def test_schema_is_declared_and_cpu_tensors_are_refused():
    """The operators exist wherever the extension loads; on CPU tensors they say where to go."""
    built = getattr(EXTENSION, "built_with_tensor_core", None)
    assert built is not None
    assert built() == EXTENSION.built_with_cuda()  # compiled together with the CUDA kernels
    q = torch.randn(1, 2, 8, 32, dtype=torch.float16)
    band = ([1, 1], [1, 1], None, None, 0.1, 0.0)
    with pytest.raises(RuntimeError, match="runs on CUDA tensors only"):
        torch.ops.local_attn.banded_forward_tensor_core(q, q, q, *band)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match="runs on CUDA tensors only"):
        torch.ops.local_attn.banded_backward_tensor_core(q, q, q, q, q, lse, *band)
