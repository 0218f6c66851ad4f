"""banded_attention: the compiled kernels and the PyTorch fallback against a dense reference."""

import contextlib
import importlib
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from local_attn_fairseq.ops import banded_attention, draw_dropout_keep, extension_info

from ..conftest import PARALLEL_THREADS
from .dense_reference import dense_allowed, dense_attention, dense_to_band
from .test_banded_tensor_core import needs_tensor_core

banded_module = importlib.import_module("local_attn_fairseq.ops.banded_attention")

IMPL_ENV = "LOCAL_ATTN_BANDED_IMPL"
EXTENSION = extension_info()
IMPLS = ["extension", "torch"] if EXTENSION["loaded"] else ["torch"]
needs_extension = pytest.mark.skipif(not EXTENSION["loaded"], reason="extension not built")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

# Tolerances against the float64 dense reference, by input dtype.
TOLERANCE = {
    torch.float64: dict(atol=1e-9, rtol=1e-9),
    torch.float32: dict(atol=2e-4, rtol=2e-4),
    torch.bfloat16: dict(atol=4e-2, rtol=4e-2),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
}


@contextlib.contextmanager
def implementation(name):
    """Force the extension or the PyTorch fallback (hypothesis cannot use monkeypatch)."""
    previous = os.environ.get(IMPL_ENV)
    os.environ[IMPL_ENV] = name
    try:
        yield
    finally:
        if previous is None:
            del os.environ[IMPL_ENV]
        else:
            os.environ[IMPL_ENV] = previous


@contextlib.contextmanager
def one_thread():
    """For the many small property cases: the thread pools' wake-ups cost more than their work,
    and far more while other processes load the machine. The parametrized cases above run
    with several threads (parallel_threads), so the kernels' parallel paths are tested there."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture
def parallel_threads():
    """Threads enough for the kernels' parallel paths (several blocks of rows at once), also
    in a test worker that runs with one thread (tests/conftest.py)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(PARALLEL_THREADS)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(params=IMPLS)
def impl(request):
    with implementation(request.param):
        yield request.param


def make_qkv(batch, heads, length, dim, dtype=torch.float64, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(batch, heads, length, dim, generator=gen) for _ in range(3)]
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in tensors]


def make_padding(kind, batch, length, seed=0):
    """(B, T) bool key padding: none, random, fairseq-style left padding, or an empty sentence."""
    if kind == "none":
        return None
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        return torch.rand(batch, length, generator=gen) < 0.3
    if kind == "left":
        lengths = torch.randint(1, length + 1, (batch,), generator=gen)
        lengths[0] = length
        return torch.arange(length)[None, :] < (length - lengths)[:, None]
    mask = torch.rand(batch, length, generator=gen) < 0.2
    mask[-1] = True  # kind == "empty_row": a sentence that is all padding
    return mask


def run_and_grad(q, k, v, left, right, padding=None, seed=1, **kwargs):
    """Output and the gradients of q, k, v under a fixed random upstream gradient."""
    out = banded_attention(q, k, v, left, right, key_padding_mask=padding, **kwargs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    grads = torch.autograd.grad(out, (q, k, v), upstream.to(out.device, out.dtype))
    return out, grads, upstream


def dense_and_grad(q, k, v, left, right, padding, upstream, **kwargs):
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    mask = None if padding is None else padding.cpu()
    out, weights = dense_attention(*leaves, left, right, mask, **kwargs)
    grads = torch.autograd.grad(out, leaves, upstream.double())
    return out, grads, weights


def assert_matches_dense(q, k, v, left, right, padding=None, **kwargs):
    out, grads, upstream = run_and_grad(q, k, v, left, right, padding, **kwargs)
    ref_out, ref_grads, _ = dense_and_grad(q, k, v, left, right, padding, upstream)
    tol = TOLERANCE[q.dtype]
    for got, want in zip((out, *grads), (ref_out, *ref_grads)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.detach().cpu().double(), want, **tol)


# (batch, heads, length, dim, left, right, padding kind)
CASES = {
    "symmetric": (2, 2, 37, 8, 4, 4, "none"),
    "per_head_asymmetric": (2, 3, 29, 5, [0, 3, 9], [5, 0, 2], "random"),
    "per_head_tensor": (1, 4, 40, 16, torch.tensor([1, 2, 8, 0]), torch.tensor([0, 7, 8, 3]),
                        "none"),
    "left_padded_sentences": (3, 2, 33, 8, 3, 6, "left"),
    "empty_sentence": (2, 2, 21, 4, 2, 2, "empty_row"),
    "window_beyond_length": (2, 1, 12, 6, 17, 2, "random"),
    "self_only": (1, 2, 9, 3, 0, 0, "random"),
    "crosses_blocks": (1, 2, 150, 16, 40, 70, "random"),
    "parallel_phases": (2, 2, 400, 32, 90, 30, "random"),
}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The build.


def test_extension_is_built_and_loaded():
    if os.environ.get("LOCAL_ATTN_NO_EXTENSION") == "1":
        pytest.skip("LOCAL_ATTN_NO_EXTENSION=1: the build was skipped on purpose")
    assert EXTENSION["loaded"], EXTENSION.get("error")
    assert EXTENSION["cpu_isa"] in {"avx512", "avx2", "baseline"}
    with implementation("auto"):
        assert banded_module.choose_route(torch.device("cpu")) == "extension"


def test_importing_the_plugin_does_not_load_the_extension():
    code = "import sys, local_attn_fairseq.ops; print('_banded_C' in ' '.join(sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "False"


def test_missing_extension_falls_back_with_one_warning(monkeypatch):
    state = banded_module._ExtensionState
    monkeypatch.setattr(state, "attempted", True)
    monkeypatch.setattr(state, "module", None)
    monkeypatch.setattr(state, "error", ImportError("No module named '_banded_C'"))
    monkeypatch.setattr(state, "warned", set())
    q, k, v = make_qkv(1, 2, 10, 4)
    with implementation("auto"):
        with pytest.warns(RuntimeWarning, match="pip install --no-build-isolation -e"):
            first = banded_attention(q, k, v, 2, 1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            second = banded_attention(q, k, v, 2, 1)
    torch.testing.assert_close(first, second)
    with implementation("extension"), pytest.raises(RuntimeError, match="cannot be imported"):
        banded_attention(q, k, v, 2, 1)


def test_unknown_implementation_is_rejected():
    q, k, v = make_qkv(1, 1, 4, 2)
    message = "LOCAL_ATTN_BANDED_IMPL='triton'.*auto, extension, torch, sdpa, tensor-core"
    with implementation("triton"), pytest.raises(ValueError, match=message):
        banded_attention(q, k, v, 1, 1)


# ---------------------------------------------------------------------------------------------
# Values and gradients.


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_matches_dense_reference(impl, case, dtype, parallel_threads):
    batch, heads, length, dim, left, right, padding = CASES[case]
    q, k, v = make_qkv(batch, heads, length, dim, dtype)
    assert_matches_dense(q, k, v, left, right, make_padding(padding, batch, length))


def test_gradcheck(impl):
    q, k, v = make_qkv(2, 2, 7, 3)
    padding = make_padding("empty_row", 2, 7)
    left, right = [1, 3], [2, 0]
    assert torch.autograd.gradcheck(
        lambda *qkv: banded_attention(*qkv, left, right, padding), (q, k, v)
    )

    def with_dropout(*qkv):
        torch.manual_seed(3)  # the same mask at every evaluation
        return banded_attention(*qkv, left, right, padding, dropout_p=0.3)

    with torch.random.fork_rng():
        assert torch.autograd.gradcheck(with_dropout, (q, k, v))


@pytest.mark.parametrize("case", ["per_head_asymmetric", "window_beyond_length", "empty_sentence"])
def test_return_weights_in_band_layout(impl, case):
    batch, heads, length, dim, left, right, kind = CASES[case]
    q, k, v = make_qkv(batch, heads, length, dim)
    padding = make_padding(kind, batch, length)
    out, weights = banded_attention(q, k, v, left, right, padding, return_weights=True)
    # the band of the windows clipped to T - 1: keys past the sequence have no column
    max_left = min(max(left) if isinstance(left, list) else left, length - 1)
    max_right = min(max(right) if isinstance(right, list) else right, length - 1)
    assert weights.shape == (batch, heads, length, max_left + max_right + 1)
    _, dense_weights = dense_attention(q, k, v, left, right, padding)
    torch.testing.assert_close(weights, dense_to_band(dense_weights, max_left, max_right))
    row_sums = weights.sum(-1)
    assert torch.all(((row_sums - 1).abs() < 1e-9) | (row_sums == 0))
    torch.testing.assert_close(out, dense_attention(q, k, v, left, right, padding)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_rows_without_keys_give_zeros_and_zero_gradients(impl, dtype):
    q, k, v = make_qkv(2, 2, 16, 8, dtype)
    padding = torch.zeros(2, 16, dtype=torch.bool)
    padding[1] = True  # an all-padding sentence
    padding[0, ::2] = True  # with left = right = 0, even queries see only a padded key
    out, grads, _ = run_and_grad(q, k, v, 0, 0, padding)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    assert (out[1] == 0).all() and (out[0, :, ::2] == 0).all()
    for grad in grads:
        assert (grad[1] == 0).all()
        assert (grad[0, :, ::2] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_inputs(impl, dtype):
    q, k, v = make_qkv(2, 2, 70, 16, dtype)
    assert_matches_dense(q, k, v, [5, 20], [9, 1], make_padding("left", 2, 70))


@needs_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_extension_matches_fallback(dtype):
    q, k, v = make_qkv(2, 3, 90, 24, dtype)
    padding = make_padding("random", 2, 90)
    results = []
    for name in ("extension", "torch"):
        with implementation(name), torch.random.fork_rng():
            torch.manual_seed(7)
            results.append(run_and_grad(q, k, v, [3, 30, 0], [12, 0, 5], padding, dropout_p=0.2))
    (out_a, grads_a, _), (out_b, grads_b, _) = results
    for a, b in zip((out_a, *grads_a), (out_b, *grads_b)):
        torch.testing.assert_close(a, b, **TOLERANCE[dtype])


@needs_extension
@pytest.mark.parametrize("narrower", ["baseline", "avx2"])
def test_cpu_kernel_copies_agree(monkeypatch, narrower):
    order = ["baseline", "avx2", "avx512"]
    if order.index(EXTENSION["cpu_isa"]) <= order.index(narrower):
        pytest.skip(f"this CPU's widest copy is {EXTENSION['cpu_isa']}")
    q, k, v = make_qkv(2, 2, 100, 20, torch.float32)
    padding = make_padding("random", 2, 100)
    with implementation("extension"):
        widest = run_and_grad(q, k, v, [7, 30], [30, 2], padding)
        monkeypatch.setenv("LOCAL_ATTN_CPU_ISA", narrower)
        assert banded_module.load_extension().cpu_isa() == narrower
        other = run_and_grad(q, k, v, [7, 30], [30, 2], padding)
    for a, b in zip((widest[0], *widest[1]), (other[0], *other[1])):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Dropout.


def test_dropout_zero_is_no_dropout_and_draws_nothing(impl):
    q, k, v = make_qkv(1, 2, 20, 4)
    rng = torch.get_rng_state()
    plain = banded_attention(q, k, v, 3, 3)
    assert torch.equal(banded_attention(q, k, v, 3, 3, dropout_p=0.0), plain)
    assert torch.equal(torch.get_rng_state(), rng)


def test_dropout_uses_the_band_mask_it_draws(impl):
    batch, heads, length, dim, left, right = 2, 2, 15, 4, [2, 20], [4, 1]
    q, k, v = make_qkv(batch, heads, length, dim)
    padding = make_padding("random", batch, length)
    with torch.random.fork_rng():
        torch.manual_seed(11)
        out, grads, upstream = run_and_grad(q, k, v, left, right, padding, dropout_p=0.4)
        torch.manual_seed(11)
        width = min(max(left), length - 1) + min(max(right), length - 1) + 1
        keep = draw_dropout_keep((batch, heads, length, width), 0.4, q.device)
    assert 0 < keep.float().mean() < 1
    ref_out, ref_grads, _ = dense_and_grad(
        q, k, v, left, right, padding, upstream, keep=keep, dropout_p=0.4
    )
    for got, want in zip((out, *grads), (ref_out, *ref_grads)):
        torch.testing.assert_close(got, want)


def test_dropout_preserves_the_expected_output(impl):
    q, k, v = make_qkv(1, 1, 6, 4)
    with torch.no_grad():
        plain = banded_attention(q, k, v, 2, 2)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            draws = torch.stack(
                [banded_attention(q, k, v, 2, 2, dropout_p=0.2) for _ in range(400)]
            )
    torch.testing.assert_close(draws.mean(0), plain, atol=0.1, rtol=0)
    assert not torch.allclose(draws[0], plain)


def test_dropout_one_drops_everything(impl):
    q, k, v = make_qkv(1, 2, 8, 4)
    assert (banded_attention(q, k, v, 2, 2, dropout_p=1.0) == 0).all()


# ---------------------------------------------------------------------------------------------
# Validation.


def _call(**changes):
    q, k, v = make_qkv(2, 3, 10, 4)
    args = dict(q=q, k=k, v=v, left=2, right=2, key_padding_mask=None)
    args.update(changes)
    return banded_attention(**args)


BAD_CALLS = {
    "q_not_4d": (dict(q=torch.zeros(3, 10, 4)), "4-D"),
    "k_shape": (dict(k=torch.zeros(2, 3, 11, 4)), "same shape"),
    "v_dtype": (dict(v=torch.zeros(2, 3, 10, 4, dtype=torch.float32)), "dtype"),
    "integer_inputs": (
        dict(q=torch.zeros(2, 3, 10, 4, dtype=torch.long),
             k=torch.zeros(2, 3, 10, 4, dtype=torch.long),
             v=torch.zeros(2, 3, 10, 4, dtype=torch.long)),
        "floating point",
    ),
    "negative_left": (dict(left=-1), ">= 0"),
    "negative_per_head": (dict(right=[1, -2, 0]), ">= 0"),
    "per_head_length": (dict(left=torch.tensor([1, 2])), "2 per-head windows for 3 heads"),
    "float_window_tensor": (dict(left=torch.tensor([1.0, 2.0, 3.0])), "integers"),
    "float_window": (dict(left=2.0), "left must be an int.*got float 2.0"),
    "float_in_list": (dict(right=[1, 2.5, 0]), "right must be an int.*got float 2.5"),
    "numpy_float_window": (dict(left=np.float64(3)), "left must be an int.*float64"),
    "numpy_float_array": (dict(right=np.array([1.0, 2.0, 3.0])), "integers"),
    "numpy_2d": (dict(left=np.ones((3, 1), dtype=np.int64)), "1-D"),
    "string_window": (dict(left="3"), "left must be an int"),
    "window_2d": (dict(right=torch.ones(3, 1, dtype=torch.long)), "1-D"),
    "bool_window": (dict(left=True), "bool"),
    "mask_shape": (dict(key_padding_mask=torch.zeros(2, 9, dtype=torch.bool)),
                   r"\(batch, length\)"),
    "mask_float": (dict(key_padding_mask=torch.zeros(2, 10)), "bool"),
    "dropout_range": (dict(dropout_p=1.5), r"\[0, 1\]"),
}  # fmt: skip


@pytest.mark.parametrize("name", BAD_CALLS, ids=list(BAD_CALLS))
def test_invalid_arguments_are_rejected(name):
    changes, message = BAD_CALLS[name]
    with pytest.raises(ValueError, match=message):
        _call(**changes)


@pytest.mark.parametrize(
    "window", [np.int64(2), np.array([2, 2, 2]), torch.tensor(2), (2, 2, 2), [np.int32(2)] * 3]
)
def test_integer_windows_of_any_type_are_accepted(window):
    q, k, v = make_qkv(2, 3, 10, 4)
    torch.testing.assert_close(
        banded_attention(q, k, v, window, window), banded_attention(q, k, v, 2, 2)
    )


# ---------------------------------------------------------------------------------------------
# Edge cases.


@pytest.mark.parametrize("shape", [(2, 3, 0, 4), (2, 0, 5, 4), (1, 2, 5, 0)])
def test_empty_inputs_stay_in_the_graph(impl, shape):
    q, k, v = (torch.zeros(shape, requires_grad=True) for _ in range(3))
    out = banded_attention(q, k, v, 3, 1)
    assert out.shape == shape and out.requires_grad
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == shape


def test_return_weights_clips_a_window_far_beyond_the_sequence(impl):
    q, k, v = make_qkv(1, 2, 16, 4)
    out, weights = banded_attention(q, k, v, 10**12, [0, 10**15], return_weights=True)
    assert weights.shape == (1, 2, 16, 15 + 15 + 1)
    _, dense_weights = dense_attention(q, k, v, 15, [0, 15])
    torch.testing.assert_close(weights, dense_to_band(dense_weights, 15, 15))
    torch.testing.assert_close(out, banded_attention(q, k, v, 15, [0, 15]))
    empty = banded_attention(*make_qkv(1, 2, 0, 4), 10**12, 10**12, return_weights=True)[1]
    assert empty.shape == (1, 2, 0, 1)


def _nonfinite_rule(q, k, v, left, right, padding):
    """The expected output: dense attention over the allowed keys with the non-finite entries
    read as 0, and NaN wherever an allowed key holds one (its weight is positive)."""
    bad = ~torch.isfinite(v)
    expected, _ = dense_attention(q, k, v.masked_fill(bad, 0), left, right, padding)
    batch, heads, length, _ = q.shape
    allowed = dense_allowed(batch, heads, length, left, right, padding).double()
    reached = (allowed @ bad.double()) > 0  # (B, H, T, D): an allowed key's entry is bad
    return expected.masked_fill(reached, float("nan")), reached


def check_nonfinite_values_reach_exactly_their_queries(route, dtype, dim=8, device="cpu"):
    batch, heads, length = 2, 2, 150
    q, k, v = (t.detach() for t in make_qkv(batch, heads, length, dim, dtype, device=device))
    v[0, 0, 70] = float("nan")  # a whole value row
    v[0, 1, 3, 2] = float("inf")  # one entry, near the start
    v[1, :, 100] = float("nan")  # a padded key: reaches nothing
    v[1, 0, 40, 5] = float("-inf")
    padding = torch.zeros(batch, length, dtype=torch.bool)
    padding[1, 95:105] = True
    left, right = [5, 30], [9, 0]
    with implementation(route):
        assert banded_module.choose_route(q.device, dtype, dim) == route
        out = banded_attention(q, k, v, left, right, padding.to(device)).cpu()
    q, k, v = (t.cpu().double() for t in (q, k, v))
    expected, reached = _nonfinite_rule(q, k, v, left, right, padding)
    assert 0 < reached.sum() < reached.numel() // 10  # a few rows, not the whole sequence
    assert torch.equal(torch.isnan(out), reached)
    torch.testing.assert_close(out.double(), expected, equal_nan=True, **TOLERANCE[dtype])


def check_a_nan_query_makes_its_own_row_nan(route, dtype, dim=8, device="cpu"):
    """Not zeros: a row whose logits are NaN has keys, unlike a row without any (zeros)."""
    q, k, v = (t.detach() for t in make_qkv(2, 2, 30, dim, dtype, device=device))
    padding = torch.zeros(2, 30, dtype=torch.bool, device=device)
    padding[0] = True
    padding[0, 5] = False  # sentence 0 has one key, 5
    padding[1, 20:] = True
    q[0, 1, 7] = float("nan")  # a whole query row that sees key 5 (window 3 .. 7)
    q[0, 1, 12] = float("nan")  # a row without keys (window 8 .. 12): zeros all the same
    q[1, 0, 5, 3] = float("nan")  # one entry: every logit of the row
    with implementation(route):
        assert banded_module.choose_route(q.device, dtype, dim) == route
        out = banded_attention(q, k, v, [3, 4], [2, 0], padding).cpu()
    expected = torch.zeros(out.shape, dtype=torch.bool)
    expected[0, 1, 7] = expected[1, 0, 5] = True
    assert torch.equal(torch.isnan(out), expected)
    assert not out[0, 1, 12].any() and not out[0, 1, 10:].any()  # rows without keys


FINITENESS_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@needs_extension
@pytest.mark.parametrize("dtype", FINITENESS_DTYPES, ids=str)
@pytest.mark.parametrize("numel", [1, 7, 4099, 2**16, 2**16 + 1])  # read in place, then summed
def test_the_extension_finds_every_nonfinite_value_on_the_cpu(dtype, numel):
    all_finite = banded_module.load_extension().all_finite
    finfo = torch.finfo(dtype)
    values = torch.full((numel,), finfo.max, dtype=dtype)
    values[::2] = finfo.tiny  # the smallest normal and the largest finite exponents
    assert all_finite(values) and all_finite(-values)
    for position in {0, numel // 2, numel - 1}:
        for bad in (float("nan"), float("inf"), float("-inf")):
            broken = values.clone()
            broken[position] = bad
            assert not all_finite(broken), (position, bad)
    strided = torch.zeros(numel, 2, dtype=dtype)
    strided[-1, 1] = float("nan")
    assert all_finite(strided[:, 0]) and not all_finite(strided[:, 1])


@needs_extension
def test_the_finiteness_check_names_what_it_cannot_read():
    all_finite = banded_module.load_extension().all_finite
    with pytest.raises(ValueError, match="floating point CPU tensor, got Long"):
        all_finite(torch.ones(3, dtype=torch.long))
    with pytest.raises(TypeError, match="takes a tensor"):
        all_finite([1.0])


def test_windows_are_checked_on_every_call_not_only_the_first():
    """The clipped band is worked out once per windows and sizes; a refused window is refused
    again (a bool among ints is never the int it compares equal to)."""
    q, k, v = make_qkv(1, 2, 6, 4)
    per_head = banded_attention(q, k, v, [1, 1], 1)
    torch.testing.assert_close(per_head, banded_attention(q, k, v, 1, 1))
    for _ in range(2):
        with pytest.raises(ValueError, match="got a bool"):
            banded_attention(q, k, v, [1, True], 1)
        with pytest.raises(ValueError, match="windows must be >= 0"):
            banded_attention(q, k, v, (1, -1), 1)
    left, right, width = banded_module.clipped_band([9, 2], (0, 40), 2, 6)
    assert (left, right, width) == ((5, 2), (0, 5), 11)


@pytest.mark.parametrize("route", IMPLS + ["sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_a_nonfinite_value_reaches_exactly_the_queries_that_see_it(route, dtype):
    check_nonfinite_values_reach_exactly_their_queries(route, dtype)


@pytest.mark.parametrize("route", IMPLS + ["sdpa"])
def test_a_nan_query_makes_its_own_row_nan_on_every_route(route):
    check_a_nan_query_makes_its_own_row_nan(route, torch.float32)


# ---------------------------------------------------------------------------------------------
# The operators as PyTorch sees them.


def _forward_samples():
    q, k, v = make_qkv(2, 2, 19, 5)
    padding = make_padding("empty_row", 2, 19)
    q32, k32, v32 = make_qkv(1, 3, 70, 8, torch.float32)
    keep = torch.rand(1, 3, 70, 13, generator=torch.Generator().manual_seed(0)) > 0.3
    return [
        (q, k, v, [2, 2], [2, 2], None, None, 0.5, 0.0),
        (q, k, v, [0, 5], [3, 1], padding, None, 0.3, 0.0),
        (q32, k32, v32, [4, 0, 9], [3, 3, 1], None, keep, 0.35, 0.3),
    ]


@needs_extension
def test_autograd_of_the_operators_is_registered_in_cpp():
    """A differentiable call is one dispatcher hop into C++: the Autograd key's kernel is the
    extension's own, not a Python function wrapped around the operator."""
    for name in ("banded_forward", "banded_forward_tensor_core"):
        table = torch._C._dispatch_dump(f"local_attn::{name}")
        autograd = [line for line in table.splitlines() if line.startswith("Autograd")]
        assert len(autograd) == 1 and "banded_attention_autograd.cpp" in autograd[0], table


@needs_extension
def test_opcheck_forward():
    for args in _forward_samples():
        torch.library.opcheck(torch.ops.local_attn.banded_forward.default, args)
        no_grad = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        torch.library.opcheck(torch.ops.local_attn.banded_forward.default, no_grad)


@needs_extension
def test_opcheck_backward():
    for q, k, v, left, right, padding, keep, scale, p in _forward_samples():
        q, k, v = (t.detach() for t in (q, k, v))
        out, lse = torch.ops.local_attn.banded_forward(
            q, k, v, left, right, padding, keep, scale, p
        )
        grad = torch.randn_like(out)
        args = (grad, q, k, v, out, lse, left, right, padding, keep, scale, p)
        torch.library.opcheck(torch.ops.local_attn.banded_backward.default, args)


@needs_extension
def test_torch_compile_matches_eager():
    q, k, v = make_qkv(2, 2, 40, 8, torch.float32)
    padding = make_padding("left", 2, 40)

    def loss(q, k, v):
        return (banded_attention(q, k, v, [3, 8], [5, 0], padding) ** 2).sum()

    torch._dynamo.reset()
    with implementation("extension"):
        eager = torch.autograd.grad(loss(q, k, v), (q, k, v))
        compiled_loss = torch.compile(loss, backend="aot_eager")
        compiled = torch.autograd.grad(compiled_loss(q, k, v), (q, k, v))
    torch._dynamo.reset()
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------------
# Properties over random shapes, windows and padding (hundreds of cases; most sequences short).


@st.composite
def problems(draw):
    batch, heads = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    short = st.integers(1, 24)
    length = draw(st.one_of(short, short, short, st.integers(25, 300)))
    dim = draw(st.sampled_from([1, 2, 3, 5, 8, 16, 17, 32, 64]))
    window = st.integers(0, length + 5)
    if draw(st.booleans()):
        left, right = draw(window), draw(window)
    else:
        left = draw(st.lists(window, min_size=heads, max_size=heads))
        right = draw(st.lists(window, min_size=heads, max_size=heads))
        if draw(st.booleans()):
            left, right = torch.tensor(left), torch.tensor(right)
    padding = draw(st.sampled_from(["none", "random", "left", "empty_row"]))
    seed = draw(st.integers(0, 2**31 - 1))
    return batch, heads, length, dim, left, right, padding, seed


PROPERTY_SETTINGS = dict(
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@settings(max_examples=300, **PROPERTY_SETTINGS)
@given(
    problem=problems(),
    impl_name=st.sampled_from(IMPLS),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_property_matches_dense(problem, impl_name, dtype):
    batch, heads, length, dim, left, right, kind, seed = problem
    q, k, v = make_qkv(batch, heads, length, dim, dtype, seed)
    with implementation(impl_name), one_thread():
        assert_matches_dense(q, k, v, left, right, make_padding(kind, batch, length, seed))


@settings(max_examples=100, **PROPERTY_SETTINGS)
@given(problem=problems(), impl_name=st.sampled_from(IMPLS))
def test_property_bfloat16(problem, impl_name):
    batch, heads, length, dim, left, right, kind, seed = problem
    q, k, v = make_qkv(batch, heads, length, dim, torch.bfloat16, seed)
    with implementation(impl_name), one_thread():
        assert_matches_dense(q, k, v, left, right, make_padding(kind, batch, length, seed))


@needs_extension
@settings(max_examples=120, **PROPERTY_SETTINGS)
@given(problem=problems(), dropout_p=st.sampled_from([0.0, 0.1, 0.5]))
def test_property_extension_matches_fallback(problem, dropout_p):
    batch, heads, length, dim, left, right, kind, seed = problem
    q, k, v = make_qkv(batch, heads, length, dim, torch.float32, seed)
    padding = make_padding(kind, batch, length, seed)
    results = []
    for name in ("extension", "torch"):
        with implementation(name), torch.random.fork_rng(), one_thread():
            torch.manual_seed(seed)
            results.append(run_and_grad(q, k, v, left, right, padding, dropout_p=dropout_p))
    (out_a, grads_a, _), (out_b, grads_b, _) = results
    for a, b in zip((out_a, *grads_a), (out_b, *grads_b)):
        torch.testing.assert_close(a, b, **TOLERANCE[torch.float32])


# ---------------------------------------------------------------------------------------------
# CUDA (run where a GPU is present).


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_cuda_matches_dense_reference(impl, case, dtype):
    batch, heads, length, dim, left, right, padding = CASES[case]
    q, k, v = make_qkv(batch, heads, length, dim, dtype, device="cuda")
    padding = make_padding(padding, batch, length)
    assert_matches_dense(q, k, v, left, right, None if padding is None else padding.cuda())


@needs_cuda
@needs_extension
def test_cuda_kernels_are_built():
    assert EXTENSION["cuda"], "the extension was built without its CUDA kernels"


@needs_cuda
@needs_extension
def test_cuda_gradcheck_and_opcheck():
    q, k, v = make_qkv(2, 2, 11, 3, device="cuda")
    padding = make_padding("empty_row", 2, 11).cuda()
    with implementation("extension"):
        assert torch.autograd.gradcheck(
            lambda *qkv: banded_attention(*qkv, [1, 4], [3, 0], padding), (q, k, v)
        )
    for args in _forward_samples():
        cuda_args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
        torch.library.opcheck(torch.ops.local_attn.banded_forward.default, cuda_args)


@needs_cuda
@needs_extension
def test_cuda_matches_cpu_with_dropout():
    q, k, v = make_qkv(2, 3, 130, 64, torch.float32)
    padding = make_padding("random", 2, 130)
    keep = torch.rand(2, 3, 130, 41) > 0.25
    args = ([5, 20, 0], [20, 3, 9], padding, keep, 0.125, 0.25)
    with torch.no_grad():
        out_cpu, lse_cpu = torch.ops.local_attn.banded_forward(q, k, v, *args)
        cuda_args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
        out_gpu, lse_gpu = torch.ops.local_attn.banded_forward(
            q.cuda(), k.cuda(), v.cuda(), *cuda_args
        )
    torch.testing.assert_close(out_gpu.cpu(), out_cpu, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_gpu.cpu(), lse_cpu, atol=1e-5, rtol=1e-5)


# (route, dtype, head dim) of every route a CUDA call can take
CUDA_ROUTES = [
    pytest.param("extension", torch.float32, 8, id="extension-float32-d8"),
    pytest.param("extension", torch.float16, 24, id="extension-float16-d24"),
    pytest.param("torch", torch.float32, 8, id="torch-float32-d8"),
    pytest.param("sdpa", torch.bfloat16, 16, id="sdpa-bfloat16-d16"),
    pytest.param("tensor-core", torch.bfloat16, 64, id="tensor-core-bfloat16-d64",
                 marks=needs_tensor_core),
    pytest.param("tensor-core", torch.float16, 32, id="tensor-core-float16-d32",
                 marks=needs_tensor_core),
]  # fmt: skip


@needs_cuda
@needs_extension
@pytest.mark.parametrize("route, dtype, dim", CUDA_ROUTES)
@pytest.mark.parametrize(
    "check",
    [check_a_nan_query_makes_its_own_row_nan, check_nonfinite_values_reach_exactly_their_queries],
    ids=["nan_query_row", "nonfinite_values"],
)
def test_cuda_nonfinite_inputs_follow_the_rule_on_every_route(check, route, dtype, dim):
    check(route, dtype, dim, device="cuda")


@needs_cuda
@needs_extension
def test_cuda_head_dim_above_the_kernel_limit_falls_back():
    q, k, v = make_qkv(1, 2, 9, 300, torch.float32, device="cuda")
    banded_module._ExtensionState.warned.discard("cuda/300")  # the warning is given once
    with implementation("auto"), pytest.warns(RuntimeWarning, match="head dim 300"):
        assert banded_module.choose_route(q.device, q.dtype, 300) == "torch"
        assert_matches_dense(q, k, v, 2, 3)


@needs_tensor_core
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dim", [32, 64, 128])
@pytest.mark.parametrize(
    "case",
    ["per_head_asymmetric", "per_head_tensor", "left_padded_sentences", "empty_sentence",
     "window_beyond_length", "crosses_blocks", "parallel_phases"],
)  # fmt: skip
def test_cuda_tensor_core_route_matches_dense_reference(case, dim, dtype):
    """The user's path to the tensor-core kernel: LOCAL_ATTN_BANDED_IMPL and banded_attention,
    with its padding and per-head windows, through autograd."""
    batch, heads, length, _, left, right, padding = CASES[case]
    q, k, v = make_qkv(batch, heads, length, dim, dtype, device="cuda")
    padding = make_padding(padding, batch, length)
    with implementation("tensor-core"):
        assert banded_module.choose_route(q.device, dtype, dim) == "tensor-core"
        assert_matches_dense(q, k, v, left, right, None if padding is None else padding.cuda())
