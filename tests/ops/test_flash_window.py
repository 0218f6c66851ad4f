"""The flash-window route (ops/flash_window.py): PyTorch's FlashAttention-2 kernels with windows.

On the CPU the library call is replaced by its float64 emulation (flash_attention_emulator.py,
written from the library's contract), so that the adapter's own translation (windows, head
groups, packing of padding on either side, the log-sum-exp's layout, dropout's RNG state) runs
and is compared with the operator's float64 reference. The CUDA tests run the real kernels.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from local_attn_fairseq.ops import banded_reference, flash_window
from local_attn_fairseq.ops.flash_window import (
    flash_window_attention,
    library_window,
    unsupported_reasons,
)

from . import flash_attention_emulator as emulator
from .dense_reference import dense_attention

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

TOLERANCE = {
    torch.float64: dict(atol=1e-5, rtol=1e-5),  # the library's log-sum-exp is float32
    torch.bfloat16: dict(atol=4e-2, rtol=4e-2),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
}
# float32 log-sum-exp; the kernels' exp2 / log approximations on half-precision inputs
LSE_TOLERANCE = {
    torch.float64: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-3, rtol=2e-3),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


@pytest.fixture
def emulated(monkeypatch):
    """The adapter's library call goes to the emulation."""
    monkeypatch.setattr(flash_window, "_library", emulator)


def make_qkv(batch, heads, queries, keys, dim, dtype=torch.float64, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads, queries, dim), (batch, heads, keys, dim), (batch, heads, keys, dim)]
    return [torch.randn(s, generator=gen).to(device, dtype).requires_grad_() for s in shapes]


def make_padding(kind, batch, length, seed=0):
    """(B, Tk) bool, True = padding: none, left (fairseq's sources), right, a sentence that is all
    padding among left-padded ones, or holes inside sentences (which the route refuses)."""
    if kind == "none":
        return None
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[0] = length - 1
    position = torch.arange(length)[None, :]
    if kind == "right":
        return position >= lengths[:, None]
    mask = position < (length - lengths)[:, None]
    if kind == "all_padding_sentence":
        mask[-1] = True
    if kind == "holes":
        mask[0, length // 2] = True
    return mask


def reference(q, k, v, left, right, padding, scale, upstream):
    """Output, log-sum-exp and gradients of q, k, v in float64, by the operator's own semantics
    (tests/ops/dense_reference.py, ops/banded_reference.py): Tk - Tq zero queries are put in
    front, so that query i sits at key position i + Tk - Tq, and their rows are dropped."""
    batch, heads, queries, dim = q.shape
    keys = k.shape[2]
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    early = leaves[0].new_zeros(batch, heads, keys - queries, dim)
    q_full = torch.cat([early, leaves[0]], dim=2)
    mask = None if padding is None else padding.cpu()
    out_full, _ = dense_attention(q_full, leaves[1], leaves[2], left, right, mask, scale)
    out = out_full[:, :, keys - queries :]
    grads = torch.autograd.grad(out, leaves, upstream.cpu().double())
    clip = [min(w, keys - 1) for w in left], [min(w, keys - 1) for w in right]
    _, lse = banded_reference.band_probs(q_full.detach(), leaves[1].detach(), *clip, mask, scale)
    return out.detach(), lse[:, :, keys - queries :], grads


def real_queries(padding, batch, queries):
    """(B, Tq) bool: queries whose own key position is not padding."""
    if padding is None:
        return torch.ones(batch, queries, dtype=torch.bool)
    return ~padding[:, padding.shape[1] - queries :].cpu()


def check_against_reference(q, k, v, left, right, padding=None, scale=0.4, dropout_p=0.0):
    batch, heads, queries, _ = q.shape
    real = real_queries(padding, batch, queries)
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).double()
    upstream = upstream * real[:, None, :, None]  # padded query rows are not compared
    out, lse = flash_window_attention(q, k, v, left, right, padding, scale, dropout_p)
    grads = torch.autograd.grad(out, (q, k, v), upstream.to(out.device, out.dtype))
    ref_out, ref_lse, ref_grads = reference(q, k, v, left, right, padding, scale, upstream)
    tol = TOLERANCE[q.dtype]
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == (batch, heads, queries)
    rows = real[:, None, :].expand(batch, heads, queries)
    out, lse = out.detach().cpu().double(), lse.cpu().double()
    torch.testing.assert_close(out[rows], ref_out[rows], **tol)
    assert (out[~rows] == 0).all(), "a padded query's row must be zeros"
    torch.testing.assert_close(lse[rows], ref_lse[rows], **LSE_TOLERANCE[q.dtype])
    assert torch.isneginf(lse[~rows]).all(), "a padded query's log-sum-exp must be -inf"
    for name, got, want in zip("qkv", grads, ref_grads):
        assert torch.isfinite(got).all(), f"d{name} has non-finite values"
        torch.testing.assert_close(got.cpu().double(), want, **tol, msg=lambda m: f"d{name}: {m}")


# (batch, heads, queries, keys, dim, left, right, padding)
CASES = {
    "no_padding": (2, 2, 11, 11, 8, [2, 2], [3, 3], "none"),
    "left_padding": (3, 2, 13, 13, 8, [1, 4], [2, 0], "left"),
    "right_padding": (3, 2, 13, 13, 8, [3, 0], [1, 5], "right"),
    "all_padding_sentence": (3, 2, 10, 10, 8, [2, 1], [1, 2], "all_padding_sentence"),
    "per_head_windows": (2, 4, 12, 12, 8, [3, 0, 3, 1], [1, 2, 1, 0], "left"),
    "per_head_windows_unpadded": (2, 4, 10, 10, 8, [3, 0, 3, 1], [1, 2, 1, 0], "none"),
    "window_covers_the_sequence": (2, 2, 9, 9, 8, [40, 9], [50, 2], "none"),
    "padded_window_covers_the_sentence": (3, 3, 9, 9, 8, [8, 1, 30], [8, 30, 0], "left"),
    "fewer_queries_than_keys": (2, 3, 4, 10, 8, [2, 0, 9], [0, 3, 9], "none"),
    "fewer_queries_padded": (3, 2, 5, 12, 16, [3, 6], [1, 0], "left"),
    "fewer_queries_right_padded": (3, 2, 5, 12, 8, [3, 0], [2, 4], "right"),
    "one_query": (2, 2, 1, 7, 8, [2, 7], [0, 0], "left"),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_matches_the_reference(emulated, case):
    """Outputs, log-sum-exp and the gradients of q, k and v on real rows; padded rows zero."""
    batch, heads, queries, keys, dim, left, right, padding = CASES[case]
    q, k, v = make_qkv(batch, heads, queries, keys, dim)
    check_against_reference(q, k, v, left, right, make_padding(padding, batch, keys))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["left_padding", "per_head_windows", "fewer_queries_padded"])
def test_half_precision_inputs(emulated, case, dtype):
    batch, heads, queries, keys, dim, left, right, padding = CASES[case]
    q, k, v = make_qkv(batch, heads, queries, keys, dim, dtype)
    check_against_reference(q, k, v, left, right, make_padding(padding, batch, keys))


def test_gradcheck(emulated):
    """Finite differences through padding (both sides), Tq < Tk and three window groups."""
    q, k, v = make_qkv(2, 3, 4, 7, 8)
    padding = torch.tensor([[1, 1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1, 1]], dtype=torch.bool)

    def attention(q, k, v):
        return flash_window_attention(q, k, v, [1, 6, 0], [0, 1, 6], padding, 0.5, 0.0)[0]

    assert torch.autograd.gradcheck(attention, (q, k, v), atol=1e-5, rtol=1e-4, fast_mode=True)


# -- the library's calls: how the heads are grouped, which layout ---------------------------------


class RecordingLibrary:
    """The emulation, remembering the arguments of each forward call."""

    def __init__(self):
        self.calls = []

    def _flash_attention_forward(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return emulator._flash_attention_forward(*args, **kwargs)

    _flash_attention_backward = staticmethod(emulator._flash_attention_backward)


def _recorded_calls(monkeypatch, case):
    library = RecordingLibrary()
    monkeypatch.setattr(flash_window, "_library", library)
    batch, heads, queries, keys, dim, left, right, padding = CASES[case]
    q, k, v = make_qkv(batch, heads, queries, keys, dim)
    flash_window_attention(q, k, v, left, right, make_padding(padding, batch, keys), 0.4, 0.0)
    return library.calls


def test_one_call_per_distinct_window(monkeypatch):
    """[3, 0, 3, 1] x [1, 2, 1, 0]: three windows, heads 0 and 2 sharing one."""
    calls = _recorded_calls(monkeypatch, "per_head_windows")
    windows = [(kw["window_size_left"], kw["window_size_right"]) for _, kw in calls]
    assert windows == [(3, 1), (0, 2), (1, 0)]
    assert [args[0].shape[-2] for args, _ in calls] == [2, 1, 1]
    assert all(kw["scale"] == 0.4 and args[8] is False for args, kw in calls)  # is_causal


def test_a_band_over_the_whole_sequence_is_dense_fused_attention(monkeypatch):
    calls = _recorded_calls(monkeypatch, "window_covers_the_sequence")
    windows = [(kw["window_size_left"], kw["window_size_right"]) for _, kw in calls]
    assert windows == [(-1, -1), (-1, 2)]
    assert calls[0][0][3] is None  # no padding: the dense layout


def test_padding_is_packed_with_cumulative_lengths(monkeypatch):
    """Left padding and fewer queries than keys: each sentence's real keys, and its queries
    whose own key is real, with int32 cumulative lengths and their maxima."""
    calls = _recorded_calls(monkeypatch, "fewer_queries_padded")
    args, _ = calls[0]
    padding = make_padding("left", 3, 12)
    keys = (~padding).sum(1)
    queries = keys.clamp(max=5)
    assert args[3].dtype == args[4].dtype == torch.int32
    assert args[3].tolist() == [0, *queries.cumsum(0).tolist()]
    assert args[4].tolist() == [0, *keys.cumsum(0).tolist()]
    assert (args[5], args[6]) == (queries.max().item(), keys.max().item())
    assert args[0].shape[0] == queries.sum() and args[1].shape[0] == keys.sum()


def test_library_window():
    """(left, right) pass as they are; a bound that reaches every key becomes -1."""
    assert library_window(3, 5, 20, 20) == (3, 5)
    assert library_window(0, 0, 20, 20) == (0, 0)
    assert library_window(19, 19, 20, 20) == (-1, -1)
    assert library_window(18, 19, 20, 20) == (18, -1)
    assert library_window(19, 18, 20, 20) == (-1, 18)
    # 4 queries over 10 keys: the last query is at key 9, the first at key 6.
    assert library_window(9, 3, 4, 10) == (-1, -1)
    assert library_window(8, 2, 4, 10) == (8, 2)


@pytest.mark.parametrize("queries, keys", [(1, 1), (5, 5), (3, 9), (1, 6)])
def test_translated_windows_keep_exactly_the_band(queries, keys):
    """For every window pair, the keys the kernels keep (by their documented rule) are the
    operator's band: keys p - left .. p + right of query i at key position p = i + Tk - Tq."""
    i = torch.arange(queries)[:, None] + keys - queries
    j = torch.arange(keys)[None, :]
    for left in range(keys + 2):
        for right in range(keys + 2):
            band = (j >= i - left) & (j <= i + right)
            window = emulator.kernel_windows(
                *library_window(left, right, queries, keys), False, queries, keys
            )
            assert torch.equal(emulator.kept_keys(queries, keys, window), band), (left, right)


def test_log_sum_exp_of_rows_without_keys_is_minus_infinity():
    """The kernels write +inf for a row without keys; the operator's convention is -inf, and
    the backward gets +inf back (exp(logit - lse) = 0 there, not NaN)."""
    layout = flash_window.Layout(None, 3, 3)
    library_lse = torch.tensor([[[1.0, math.inf, 2.0]]])
    lse = layout.operator_lse(library_lse, (1, 1, 3))
    assert lse.tolist() == [[[1.0, -math.inf, 2.0]]]
    assert layout.library_lse(lse).tolist() == library_lse.tolist()
    padding = torch.tensor([[True, False, False]])
    packed = flash_window.Layout(padding, 3, 3)
    lse = packed.operator_lse(torch.tensor([[math.inf, 4.0]]), (1, 1, 3))
    assert lse.tolist() == [[[-math.inf, -math.inf, 4.0]]]
    assert packed.library_lse(lse).tolist() == [[math.inf, 4.0]]


def test_a_batch_without_real_queries_gives_zeros(emulated):
    q, k, v = make_qkv(2, 2, 3, 6, 8)
    padding = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    out, lse = flash_window_attention(q, k, v, [2, 2], [1, 1], padding, 0.4, 0.0)
    assert (out == 0).all() and torch.isneginf(lse).all()
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all((g == 0).all() for g in grads)


def test_padding_inside_a_sentence_is_refused_in_one_line(emulated):
    q, k, v = make_qkv(2, 2, 9, 9, 8)
    with pytest.raises(ValueError, match=r"^flash-window: sentence 0 has padding between"):
        flash_window_attention(q, k, v, [1, 1], [1, 1], make_padding("holes", 2, 9), 0.4, 0.0)


# -- dropout through the library's RNG state ---------------------------------------------------


DROPOUT_WINDOWS = ([3, 0, 3, 1], [1, 2, 1, 0])  # three window groups, heads 0 and 2 together


def _dropout_output(seed, q, k, v, padding, p, windows=DROPOUT_WINDOWS):
    torch.manual_seed(seed)
    return flash_window_attention(q, k, v, *windows, padding, 0.4, p)[0]


def _dropout_run(seed, q, k, v, padding, p, upstream):
    out = _dropout_output(seed, q, k, v, padding, p)
    return out, torch.autograd.grad(out, (q, k, v), upstream)


def check_dropout_expectation(q, k, v, padding, windows, runs):
    """Averaged over ``runs`` seeds the output approaches the one without dropout: its error is
    within 3 / sqrt(runs) of a single run's (the kernels keep an element with probability
    (floor((1 - p) * 255) + 1) / 256 and scale by 1 / (1 - p): 0.9989 of the mean at p = 0.3)."""
    real = real_queries(padding, q.shape[0], q.shape[2]).to(q.device)[:, None, :, None]
    with torch.no_grad():
        plain = _dropout_output(0, q, k, v, padding, 0.0, windows).float()
        outputs = [_dropout_output(s, q, k, v, padding, 0.3, windows).float() for s in range(runs)]
    errors = torch.stack([((out - plain) * real).abs().mean() for out in outputs])
    mean_error = ((torch.stack(outputs).mean(0) - plain) * real).abs().mean()
    assert errors.mean() > 0.05 and mean_error < 3 * errors.mean() / math.sqrt(runs), (
        errors.mean(),
        mean_error,
    )


def test_dropout_same_seed_same_mask_other_seed_other_mask(emulated):
    q, k, v = make_qkv(2, 4, 6, 12, 8)
    padding = make_padding("left", 2, 12)
    upstream = torch.randn(q.shape, dtype=torch.float64)
    first = _dropout_run(1, q, k, v, padding, 0.3, upstream)
    again = _dropout_run(1, q, k, v, padding, 0.3, upstream)
    other = _dropout_run(2, q, k, v, padding, 0.3, upstream)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert not torch.allclose(first[0], other[0])


def test_dropout_backward_uses_the_forward_mask(emulated):
    """out is linear in v for a fixed mask, out = W v, so <upstream, out> = <dv, v> exactly when
    the backward's W^T is the forward's W: with several window groups (each call has its own RNG
    state) and padding."""
    q, k, v = make_qkv(3, 4, 7, 12, 8)
    padding = make_padding("left", 3, 12)
    upstream = torch.randn(q.shape, dtype=torch.float64)
    out, (_, _, dv) = _dropout_run(3, q, k, v, padding, 0.4, upstream)
    # (the backward recomputes W from the float32 log-sum-exp: equal to ~1e-7)
    torch.testing.assert_close((upstream * out).sum(), (dv * v).sum(), rtol=1e-6, atol=1e-6)


def test_dropout_gradcheck(emulated):
    """With the seed fixed the call is a deterministic function: finite differences agree with
    the backward, which recomputes the mask from the forward's RNG states."""
    q, k, v = make_qkv(2, 2, 4, 6, 8)
    padding = make_padding("right", 2, 6)

    def attention(q, k, v):
        torch.manual_seed(11)
        return flash_window_attention(q, k, v, [2, 0], [1, 3], padding, 0.5, 0.35)[0]

    assert torch.autograd.gradcheck(attention, (q, k, v), atol=1e-5, rtol=1e-4, fast_mode=True)


def test_dropout_expectation_is_the_output_without_dropout(emulated):
    q, k, v = make_qkv(2, 2, 6, 9, 8)
    check_dropout_expectation(q, k, v, make_padding("right", 2, 9), ([2, 4], [2, 0]), 200)


def test_deterministic_algorithms_take_the_route(emulated):
    """Under torch.use_deterministic_algorithms(True) no operation of the translation refuses on
    the CPU, and the emulated call is reproducible (TestCuda checks the GPU, where index_copy_,
    which the translation avoids, would refuse)."""
    q, k, v = make_qkv(2, 4, 6, 9, 8)
    upstream = torch.randn(q.shape, dtype=torch.float64)
    torch.use_deterministic_algorithms(True)
    try:
        runs = [_dropout_run(0, q, k, v, make_padding("left", 2, 9), 0.2, upstream) for _ in "ab"]
    finally:
        torch.use_deterministic_algorithms(False)
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)


# -- what the route refuses ---------------------------------------------------------------------


def test_unsupported_reasons_refuse_cpu_float32_and_other_head_dims():
    q, k, v = make_qkv(1, 2, 8, 8, 64, torch.float16)
    assert unsupported_reasons(q, k, v, [1, 1], [1, 1], None, 0.0) == [
        "it runs on CUDA devices only, not cpu"
    ]
    q32, k32, v32 = make_qkv(1, 2, 8, 8, 48, torch.float32)
    reasons = unsupported_reasons(q32, k32, v32, [1, 1], [1, 1], None, 0.0)
    assert "it takes float16 and bfloat16, not float32" in reasons
    assert "it takes head dims (32, 64, 128), not 48" in reasons
    q64 = q.double()
    assert "it takes float16 and bfloat16, not float64" in unsupported_reasons(
        q64, q64, q64, [1, 1], [1, 1], None, 0.0
    )


def test_unsupported_reasons_refuse_windows_that_exclude_the_query_and_more_queries():
    q, k, v = make_qkv(1, 2, 8, 6, 32, torch.bfloat16)
    reasons = unsupported_reasons(q, k, v, [1, -1], [2, 2], None, 0.0)
    assert "it takes windows >= 0 only (a band that excludes the query has none)" in reasons
    assert "it takes no more queries than keys, not 8 > 6" in reasons
    assert "its kernels take dropout_p < 1" in unsupported_reasons(q, q, q, [1], [1], None, 1.0)


def test_this_torch_has_the_library():
    assert flash_window.library_gap() is None


def test_cpu_tensors_never_reach_a_kernel_without_the_emulation():
    """Without the emulation the library has no CPU kernel: the refusal is unsupported_reasons'
    (the route table's), and a call that ignores it fails in torch's dispatcher."""
    q, k, v = make_qkv(1, 2, 8, 8, 32, torch.float16)
    assert unsupported_reasons(q, k, v, [1, 1], [1, 1], None, 0.0)
    with pytest.raises(NotImplementedError, match="_flash_attention_forward"):
        flash_window_attention(q, k, v, [1, 1], [1, 1], None, 0.4, 0.0)


# -- autograd and the operators as PyTorch sees them -----------------------------------------


def test_second_derivatives_are_refused_in_one_line(emulated):
    q, k, v = make_qkv(2, 2, 6, 6, 8)
    padding = make_padding("left", 2, 6)
    out, _ = flash_window_attention(q, k, v, [1, 2], [2, 0], padding, 0.4, 0.0)
    plain = torch.autograd.grad(out.sin().sum(), (q, k, v), retain_graph=True)
    with_graph = torch.autograd.grad(out.sin().sum(), (q, k, v), create_graph=True)
    for got, want in zip(with_graph, plain):
        torch.testing.assert_close(got, want)
    penalty = sum(g.square().sum() for g in with_graph)
    with pytest.raises(RuntimeError, match=r"^flash-window computes first derivatives only.*"
                                           r"LOCAL_ATTN_BANDED_IMPL=torch"):  # fmt: skip
        torch.autograd.grad(penalty, (q, k, v))


def test_log_sum_exp_carries_no_gradient(emulated):
    q, k, v = make_qkv(1, 2, 5, 5, 8)
    _, lse = flash_window_attention(q, k, v, [1, 1], [1, 1], None, 0.4, 0.0)
    assert not lse.requires_grad


def _operator_args(padding_kind="left", dtype=torch.float64, dim=8, device="cpu"):
    q, k, v = make_qkv(2, 3, 5, 8, dim, dtype, device=device)
    padding = make_padding(padding_kind, 2, 8)
    padding = None if padding is None else padding.to(device)
    return (q, k, v, [2, 0, 2], [1, 3, 1], padding, 0.4, 0.0)


def test_opcheck(emulated):
    """PyTorch's custom-operator contract: schema, autograd registration, fake kernels (their
    shapes and strides against the real outputs), AOT dispatch."""
    op = flash_window.flash_window_forward._opoverload
    torch.library.opcheck(op, _operator_args("none"))
    args = _operator_args("left")
    torch.library.opcheck(op, args)
    detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    out, lse, rng_states = op(*detached)
    backward_args = (torch.randn_like(out), *detached[:3], out, lse, rng_states, *args[3:])
    torch.library.opcheck(flash_window.flash_window_backward._opoverload, backward_args)


def test_torch_compile_traces_the_operators(emulated):
    """torch.compile sees the two operators (their fake kernels), with eager's results."""
    q, k, v, left, right, padding, scale, p = _operator_args()
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(str(graph_module.graph))
        return graph_module.forward

    def loss(q, k, v):
        return flash_window_attention(q, k, v, left, right, padding, scale, p)[0].square().sum()

    torch._dynamo.reset()
    eager = torch.autograd.grad(loss(q, k, v), (q, k, v))
    compiled_loss = torch.compile(loss, backend=recording_backend, fullgraph=True)
    compiled = torch.autograd.grad(compiled_loss(q, k, v), (q, k, v))
    aot = torch.autograd.grad(torch.compile(loss, backend="aot_eager")(q, k, v), (q, k, v))
    torch._dynamo.reset()
    assert "local_attn_flash_window.forward" in " ".join(graphs)
    for a, b, c in zip(eager, compiled, aot):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, c)


# ---------------------------------------------------------------------------------------------
# CUDA: the real kernels (run where a GPU is present).


@needs_cuda
class TestCuda:
    """The real kernels against the float64 reference, and against their emulation."""

    CASE_NAMES = ["no_padding", "left_padding", "right_padding", "all_padding_sentence",
                  "per_head_windows", "window_covers_the_sequence",
                  "fewer_queries_padded"]  # fmt: skip

    @pytest.mark.parametrize("dim", [32, 64, 128])
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
    @pytest.mark.parametrize("case", CASE_NAMES)
    def test_matches_the_reference(self, case, dtype, dim):
        batch, heads, queries, keys, _, left, right, padding = CASES[case]
        scale_up = 7  # longer sequences: several of the kernels' blocks of 64 or 128 rows
        queries, keys = queries * scale_up, keys * scale_up
        left, right = [w * scale_up for w in left], [w * scale_up for w in right]
        q, k, v = make_qkv(batch, heads, queries, keys, dim, dtype, device="cuda")
        mask = make_padding(padding, batch, keys)
        assert unsupported_reasons(q, k, v, left, right, mask, 0.0) == []
        mask = None if mask is None else mask.cuda()
        check_against_reference(q, k, v, left, right, mask, scale=dim**-0.5)

    @pytest.mark.parametrize("packed", [False, True])
    @pytest.mark.parametrize("window", [(3, 5), (0, 0), (-1, 4), (6, -1), (-1, -1), (200, 1)])
    def test_the_kernels_follow_their_emulation(self, packed, window):
        """The contract the CPU tests rely on, on the GPU: windows (inclusive, -1 unbounded,
        clamped), bottom-right alignment per packed sequence, the log-sum-exp's layout, and
        +inf with zeros for rows without keys (6 queries over 2 keys with window (0, 0))."""
        dtype, heads, dim = torch.bfloat16, 2, 64
        if packed:
            q_lengths, k_lengths = [70, 6, 1, 33], [90, 2, 40, 33]
            cum_q, cum_k = (F.pad(torch.tensor(n).cumsum(0), (1, 0)).to("cuda", torch.int32)
                            for n in (q_lengths, k_lengths))  # fmt: skip
            shapes = [(sum(q_lengths), heads, dim), (sum(k_lengths), heads, dim)]
            extra = (cum_q, cum_k, max(q_lengths), max(k_lengths))
        else:
            shapes = [(3, 50, heads, dim), (3, 130, heads, dim)]
            extra = (None, None, 50, 130)
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(shapes[0], generator=gen).to("cuda", dtype)
        k, v = (torch.randn(shapes[1], generator=gen).to("cuda", dtype) for _ in range(2))
        kwargs = dict(scale=0.125, window_size_left=window[0], window_size_right=window[1])
        real = torch.ops.aten._flash_attention_forward(q, k, v, *extra, 0.0, False, False, **kwargs)
        emulated = emulator._flash_attention_forward(q, k, v, *extra, 0.0, False, False, **kwargs)
        torch.testing.assert_close(real[0], emulated[0], atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(real[1], emulated[1], atol=1e-3, rtol=1e-3)
        grad = torch.randn_like(real[0])
        unused = torch.empty((), dtype=torch.uint64, device="cuda")
        real_grads = torch.ops.aten._flash_attention_backward(
            grad, q, k, v, real[0], real[1], *extra, 0.0, False, real[2], unused, **kwargs
        )
        emulated_grads = emulator._flash_attention_backward(
            grad, q, k, v, real[0], real[1], *extra, 0.0, False, real[2], unused, **kwargs
        )
        for got, want in zip(real_grads, emulated_grads):
            torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)

    def test_dropout(self):
        """Same seed, same output; the backward's mask is the forward's (<upstream, out> =
        <dv, v>); the expectation over seeds is the output without dropout."""
        q, k, v = make_qkv(2, 4, 150, 200, 64, torch.bfloat16, device="cuda")
        padding = make_padding("left", 2, 200).cuda()
        upstream = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
        out, (dq, dk, dv) = _dropout_run(1, q, k, v, padding, 0.3, upstream)
        again, grads_again = _dropout_run(1, q, k, v, padding, 0.3, upstream)
        torch.testing.assert_close(out, again, rtol=0, atol=0)
        # dq is accumulated with atomic adds: equal up to the order of its sums
        torch.testing.assert_close((dq, dk, dv), grads_again, rtol=1e-2, atol=1e-2)
        inner = (upstream.double() * out.double()).sum()
        torch.testing.assert_close(inner, (dv.double() * v.double()).sum(), rtol=2e-2, atol=1.0)
        wide = ([30, 0, 30, 60], [30, 60, 30, 0])
        check_dropout_expectation(q, k, v, padding, wide, 200)

    def test_deterministic_backward_when_asked(self):
        """torch.use_deterministic_algorithms(True) makes the kernels' backward deterministic."""
        q, k, v = make_qkv(2, 4, 300, 300, 64, torch.bfloat16, device="cuda")
        padding = make_padding("left", 2, 300).cuda()
        upstream = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
        torch.use_deterministic_algorithms(True)
        try:
            runs = [_dropout_run(0, q, k, v, padding, 0.0, upstream)[1] for _ in "ab"]
        finally:
            torch.use_deterministic_algorithms(False)
        torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)

    def test_opcheck(self):
        args = _operator_args("left", torch.float16, 32, "cuda")
        torch.library.opcheck(flash_window.flash_window_forward._opoverload, args)
