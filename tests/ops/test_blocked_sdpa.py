"""The blocked-SDPA route against the dense reference, in every case the operator's tests use."""

import pytest
import torch
from hypothesis import given, settings

from local_attn_fairseq.ops import banded_attention, banded_reference
from local_attn_fairseq.ops.blocked_sdpa import (
    BlockLayout,
    blocked_sdpa_forward,
    blocked_sdpa_output,
    default_block,
)

from .test_banded_attention import (
    CASES,
    PROPERTY_SETTINGS,
    TOLERANCE,
    assert_matches_dense,
    implementation,
    make_padding,
    make_qkv,
    one_thread,
    problems,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(autouse=True)
def sdpa_route():
    with implementation("sdpa"):
        yield


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_matches_dense_reference(case, dtype):
    batch, heads, length, dim, left, right, padding = CASES[case]
    q, k, v = make_qkv(batch, heads, length, dim, dtype)
    assert_matches_dense(q, k, v, left, right, make_padding(padding, batch, length))


# (length, left, right, block): T not a multiple of the block, windows wider than T or than
# the block, T = 1, a block of one query, causal (right = 0).
SHAPES = [
    (45, 3, 3, 16),
    (45, 20, 7, 8),
    (10, 30, 25, None),
    (1, 0, 0, None),
    (1, 5, 5, None),
    (33, [4, 0], [0, 6], 1),
    (70, [64, 2], [0, 0], 16),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("length,left,right,block", SHAPES)
def test_blocks_and_windows(length, left, right, block, dtype):
    q, k, v = make_qkv(2, 2, length, 8, dtype, seed=length)
    padding = make_padding("random", 2, length)
    reach = length - 1
    lefts = [min(w, reach) for w in (left if isinstance(left, list) else [left] * 2)]
    rights = [min(w, reach) for w in (right if isinstance(right, list) else [right] * 2)]
    out, lse = blocked_sdpa_forward(q, k, v, lefts, rights, padding, None, 0.4, 0.0, block)
    ref_out, ref_lse = banded_reference.banded_forward(
        q, k, v, lefts, rights, padding, None, 0.4, 0.0
    )
    torch.testing.assert_close(out, ref_out, **TOLERANCE[dtype])
    torch.testing.assert_close(lse, ref_lse, **TOLERANCE[dtype])
    assert lse.dtype == ref_lse.dtype
    upstream = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), upstream)
    with implementation("torch"):
        reference = banded_attention(q, k, v, lefts, rights, padding, scale=0.4)
    want = torch.autograd.grad(reference, (q, k, v), upstream)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_without_keys_give_zeros_and_zero_gradients(dtype):
    q, k, v = make_qkv(2, 2, 40, 8, dtype)
    padding = torch.zeros(2, 40, dtype=torch.bool)
    padding[1] = True  # an all-padding sentence
    padding[0, ::2] = True  # with left = right = 0, even queries see only a padded key
    out = banded_attention(q, k, v, 0, 0, padding)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    assert (out[1] == 0).all() and (out[0, :, ::2] == 0).all()
    for grad in grads:
        assert (grad[1] == 0).all() and (grad[0, :, ::2] == 0).all()
    _, lse = blocked_sdpa_forward(q, k, v, [0, 0], [0, 0], padding, None, 0.3, 0.0)
    assert torch.isneginf(lse[1]).all() and torch.isneginf(lse[0, :, ::2]).all()
    assert torch.isfinite(lse[0, :, 1::2]).all()


def test_gradcheck():
    q, k, v = make_qkv(2, 2, 9, 3)
    padding = make_padding("empty_row", 2, 9)
    assert torch.autograd.gradcheck(
        lambda *qkv: blocked_sdpa_output(*qkv, [1, 3], [2, 0], padding, 0.5, block=4), (q, k, v)
    )


def test_dropout_is_refused_by_the_route_itself():
    q, k, v = make_qkv(1, 1, 8, 4)
    keep = torch.ones(1, 1, 8, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="dropout_p = 0"):
        blocked_sdpa_forward(q, k, v, [1], [1], None, keep, 0.5, 0.1)


def test_layout_is_aligned_and_bounded():
    layout = BlockLayout(length=1000, left=[16], right=[16], block=default_block(33, 1000))
    assert layout.block == 64 and layout.n_blocks == 16
    assert layout.keys % 8 == 0 and layout.keys >= 64 + 32
    assert default_block(5, 1000) == 16 and default_block(300, 1000) == 128
    assert default_block(33, 10) == 10


@settings(max_examples=150, **PROPERTY_SETTINGS)
@given(problem=problems())
def test_property_matches_dense(problem):
    batch, heads, length, dim, left, right, kind, seed = problem
    q, k, v = make_qkv(batch, heads, length, dim, torch.float32, seed)
    with one_thread():
        assert_matches_dense(q, k, v, left, right, make_padding(kind, batch, length, seed))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_cuda_matches_dense_reference(case, dtype):
    batch, heads, length, dim, left, right, padding = CASES[case]
    q, k, v = make_qkv(batch, heads, length, dim, dtype, device="cuda")
    padding = make_padding(padding, batch, length)
    assert_matches_dense(q, k, v, left, right, None if padding is None else padding.cuda())
