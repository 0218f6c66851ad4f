"""Pande's band of the full softmax on the banded operator, and the blocked log-sum-exp over all
keys, against the dense T x T computation."""

import importlib

import pytest
import torch

from local_attn_fairseq.ops import draw_dropout_keep, extension_info
from local_attn_fairseq.ops.band_with_global_lse import all_keys_logsumexp, band_of_full_softmax

from ..locality.test_dynamic_window import TensorRecorder

lse_module = importlib.import_module("local_attn_fairseq.ops.band_with_global_lse")
IMPLS = ["extension", "torch"] if extension_info()["loaded"] else ["torch"]
TOLERANCE = {torch.float64: dict(atol=1e-10, rtol=1e-9), torch.float32: dict(atol=2e-5, rtol=2e-4)}

# identity, prev-1, next-2, band-2, prev-20 / band-30 (beyond short sequences), asymmetric
BANDS = [(0, 0), (-1, -1), (2, 2), (-2, 2), (-20, -20), (-30, 30), (-3, 1)]


def allowed_keys(batch, length, padding, causal):
    """(B, 1, T, T) bool: the keys the full softmax runs over."""
    allowed = torch.ones(batch, 1, length, length, dtype=torch.bool)
    if padding is not None:
        allowed = allowed & ~padding[:, None, None, :]
    if causal:
        allowed = allowed & torch.ones(length, length, dtype=torch.bool).tril()
    return allowed


def band_masks(bands, length):
    offset = torch.arange(length)[None, :] - torch.arange(length)[:, None]
    return torch.stack([(offset >= lo) & (offset <= hi) for lo, hi in bands])


def dense_band_of_softmax(q, k, v, bands, padding=None, causal=False, keep=None, dropout_p=0.0):
    """softmax over all allowed keys, times the 0/1 band masks (and a dense keep mask), times v."""
    batch, _, length, dim = q.shape
    logits = q @ k.transpose(-1, -2) * dim**-0.5
    logits = logits.masked_fill(~allowed_keys(batch, length, padding, causal), float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # rows without keys: zeros
    probs = probs * band_masks(bands, length)
    if keep is not None:
        probs = probs * keep / (1 - dropout_p)
    return probs @ v


def inputs(dtype, batch=3, heads=len(BANDS), length=11, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(batch, heads, length, dim, generator=generator, dtype=dtype).requires_grad_()
        for _ in range(3)
    ]


def left_padding(batch, length):
    padding = torch.zeros(batch, length, dtype=torch.bool)
    padding[1, :4] = True  # a left-padded sentence
    padding[2] = True  # a sentence of padding only
    return padding


def gradients(out, tensors, seed=1):
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, tensors, grad)


# -- the log-sum-exp over all keys ----------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_rows", [1, 3, None])
def test_logsumexp_over_all_keys_equals_the_dense_one(causal, block_rows):
    q, k, _ = inputs(torch.float64, heads=2)
    padding = left_padding(3, 11)
    lse = all_keys_logsumexp(q, k, 0.3, padding, causal, block_rows)
    logits = (q @ k.transpose(-1, -2) * 0.3).masked_fill(
        ~allowed_keys(3, 11, padding, causal), float("-inf")
    )
    expected = torch.logsumexp(logits, dim=-1)
    torch.testing.assert_close(lse, expected, **TOLERANCE[torch.float64])
    assert torch.isneginf(lse[2]).all()  # no key at all
    # gradients: where a row has keys, those of the dense logsumexp; elsewhere zero, not NaN
    has_key = torch.isfinite(expected)
    grad = torch.randn(lse.shape, dtype=torch.float64)
    ours = torch.autograd.grad(lse[has_key], (q, k), grad[has_key])
    theirs = torch.autograd.grad(expected[has_key], (q, k), grad[has_key])
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, **TOLERANCE[torch.float64])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_rows", [2, None])  # None: flash attention on the CPU
def test_logsumexp_gradcheck(causal, block_rows):
    q, k, _ = inputs(torch.float64, batch=2, heads=2, length=7, dim=3)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[1, 5:] = True  # every row keeps a key: the log-sum-exp is finite and smooth
    function = lambda q, k: all_keys_logsumexp(q, k, 0.7, padding, causal, block_rows)  # noqa
    assert torch.autograd.gradcheck(function, (q, k))


@pytest.mark.parametrize("block_rows", [2, None])
@pytest.mark.parametrize("queries,keys", [(3, 5), (5, 3)])
def test_logsumexp_of_queries_and_keys_of_different_lengths(queries, keys, block_rows):
    q = torch.randn(1, 2, queries, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, keys, 4, dtype=torch.float64, requires_grad=True)
    expected = torch.logsumexp(q @ k.transpose(-1, -2) * 0.5, dim=-1)
    lse = all_keys_logsumexp(q, k, 0.5, block_rows=block_rows)
    torch.testing.assert_close(lse, expected)
    grad = torch.randn(lse.shape, dtype=torch.float64)
    for ours, theirs in zip(
        torch.autograd.grad(lse, (q, k), grad), torch.autograd.grad(expected, (q, k), grad)
    ):
        torch.testing.assert_close(ours, theirs)
    with pytest.raises(ValueError, match="causal attention needs as many queries as keys"):
        all_keys_logsumexp(q, k, 0.5, causal=True)


def test_logsumexp_keeps_one_block_of_logits_in_forward_and_backward():
    length = 1024
    q, k = (torch.randn(1, 2, length, 8, requires_grad=True) for _ in range(2))
    recorder = TensorRecorder()
    with recorder:
        lse = all_keys_logsumexp(q, k, 0.3, block_rows=64)
        lse.sum().backward()
    assert recorder.largest <= 2 * 64 * length  # one (B, H, 64, T) block, never (B, H, T, T)
    expected = torch.logsumexp(q @ k.transpose(-1, -2) * 0.3, dim=-1)
    torch.testing.assert_close(lse, expected)


def test_without_cpu_flash_the_budget_bounds_the_default_block(monkeypatch):
    monkeypatch.setattr(lse_module, "_CPU_FLASH", None)  # a device without it, or older torch
    monkeypatch.setattr(lse_module, "LSE_BLOCK_ELEMENTS", 2**14)
    q, k = (torch.randn(1, 2, 512, 4, requires_grad=True) for _ in range(2))
    recorder = TensorRecorder()
    with recorder:
        lse = all_keys_logsumexp(q, k, 0.5)
        lse.sum().backward()
    assert recorder.largest <= 2**14
    torch.testing.assert_close(lse, torch.logsumexp(q @ k.transpose(-1, -2) * 0.5, dim=-1))


def test_cpu_flash_route_forms_no_matrix_of_logits():
    length = 2048
    q, k = (torch.randn(1, 2, length, 8, requires_grad=True) for _ in range(2))
    recorder = TensorRecorder()
    with recorder:
        all_keys_logsumexp(q, k, 0.3).sum().backward()
    assert recorder.largest <= 2 * length * 8  # tensors of the size of q, never (T, T)


# -- the band of the full softmax ---------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_band_of_full_softmax_equals_the_dense_masks(impl, dtype, causal, monkeypatch):
    monkeypatch.setenv("LOCAL_ATTN_BANDED_IMPL", impl)
    q, k, v = inputs(dtype)
    padding = left_padding(3, 11)
    out = band_of_full_softmax(q, k, v, BANDS, padding, causal=causal)
    expected = dense_band_of_softmax(q, k, v, BANDS, padding, causal)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    assert (out[2] == 0).all()  # the all-padding sentence
    for ours, theirs in zip(gradients(out, (q, k, v)), gradients(expected, (q, k, v))):
        torch.testing.assert_close(ours, theirs, **TOLERANCE[dtype])
        assert torch.isfinite(ours).all()


@pytest.mark.parametrize("length", [1, 2, 5])
def test_sequences_shorter_than_the_bands(length):
    q, k, v = inputs(torch.float64, batch=2, length=length)
    out = band_of_full_softmax(q, k, v, BANDS)
    expected = dense_band_of_softmax(q, k, v, BANDS)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float64])
    for ours, theirs in zip(gradients(out, (q, k, v)), gradients(expected, (q, k, v))):
        torch.testing.assert_close(ours, theirs, **TOLERANCE[torch.float64])


def test_band_gradcheck():
    bands = [(-1, 1), (-2, -2), (1, 1)]
    q, k, v = inputs(torch.float64, batch=2, heads=3, length=6, dim=3)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[1, :2] = True
    function = lambda q, k, v: band_of_full_softmax(q, k, v, bands, padding)  # noqa: E731
    assert torch.autograd.gradcheck(function, (q, k, v))


def test_given_logsumexp_is_used_and_receives_gradients():
    q, k, v = inputs(torch.float64, heads=2)
    bands = [(-1, 1), (0, 0)]
    lse = all_keys_logsumexp(q, k, 8**-0.5).detach().requires_grad_()
    out = band_of_full_softmax(q, k, v, bands, lse=lse)
    torch.testing.assert_close(out, dense_band_of_softmax(q, k, v, bands))
    # out_i scales with exp(-LSE_i): d out_i / d LSE_i = -out_i
    (grad_lse,) = torch.autograd.grad(out.sum(), lse)
    torch.testing.assert_close(grad_lse, -out.sum(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gives_zeros_not_nan_for_rows_without_keys(dtype):
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in inputs(torch.float32))
    padding = left_padding(3, 11)
    for causal in (False, True):
        out = band_of_full_softmax(q, k, v, BANDS, padding, causal=causal)
        expected = dense_band_of_softmax(*(t.float() for t in (q, k, v)), BANDS, padding, causal)
        assert out.dtype == dtype and (out[2] == 0).all()
        torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)
        for grad in gradients(out, (q, k, v)):
            assert torch.isfinite(grad).all()


def dense_keep(keeps, bands, batch, length, causal):
    """The band-layout keep masks drawn per shift group, as one (B, H, T, T) mask."""
    dense = torch.zeros(batch, len(bands), length, length)
    groups = lse_module._shift_groups(bands, length, causal)
    for group, keep in zip(groups, keeps):
        max_left = max(group.left)
        for column in range(keep.shape[-1]):
            for query in range(length):
                key = query - max_left + column + group.shift
                if 0 <= key < length:
                    dense[:, group.heads, query, key] = keep[:, :, query, column].float()
    return dense


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_drops_band_weights_of_the_full_softmax(impl, causal, monkeypatch):
    """With the keep masks the operator drew, out and gradients are the dense computation's."""
    monkeypatch.setenv("LOCAL_ATTN_BANDED_IMPL", impl)
    drawn = []

    def record(shape, p, device):
        keep = draw_dropout_keep(shape, p, device)
        drawn.append(keep)
        return keep

    monkeypatch.setattr(lse_module, "draw_dropout_keep", record)
    q, k, v = inputs(torch.float64)
    padding = left_padding(3, 11)
    out = band_of_full_softmax(q, k, v, BANDS, padding, dropout_p=0.4, causal=causal)
    keep = dense_keep(drawn, BANDS, 3, 11, causal)
    expected = dense_band_of_softmax(q, k, v, BANDS, padding, causal, keep, 0.4)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float64])
    for ours, theirs in zip(gradients(out, (q, k, v)), gradients(expected, (q, k, v))):
        torch.testing.assert_close(ours, theirs, **TOLERANCE[torch.float64])
    assert 0 < keep.mean() < 1  # something was dropped, something kept


def test_wrong_number_of_bands_is_an_error():
    q, k, v = inputs(torch.float32, heads=2)
    with pytest.raises(ValueError, match="3 bands for 2 heads"):
        band_of_full_softmax(q, k, v, [(0, 0)] * 3)
