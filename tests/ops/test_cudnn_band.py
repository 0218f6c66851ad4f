"""The cudnn-band route: its translation of the banded operator's call into cuDNN graphs, run on
the CPU against a float64 emulation of nvidia-cudnn-frontend's contract
(cudnn_frontend_emulator.py) and checked against a dense float64 reference; on a CUDA machine
with the frontend installed, the same against the real library (bfloat16 and float16, head dims
32, 64 and 128), with the graphs' build time and the host time per call recorded."""

import json
import math
import os
import statistics
import time

import pytest
import torch

from local_attn_fairseq.ops import cudnn_band

from . import cudnn_frontend_emulator as emulator
from .dense_reference import dense_allowed

B, H, D = 3, 4, 8
SCALE = 0.4


@pytest.fixture(autouse=True)
def one_thread():
    """Many calls on small tensors: the thread pool's wake-ups cost more than their work."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def emulated(monkeypatch):
    """The route's library replaced by the emulation (a fresh graph cache)."""
    library = cudnn_band.Frontend(emulator)
    monkeypatch.setattr(cudnn_band, "_library", library)
    return library


def make_qkv(batch, heads, query_length, key_length, dim, dtype=torch.float64, seed=0,
             device="cpu"):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads, query_length, dim)] + [(batch, heads, key_length, dim)] * 2
    return [torch.randn(s, generator=gen).to(device, dtype).requires_grad_() for s in shapes]


def padding(kind, batch, length):
    """(B, Tk) bool, True = padding: one contiguous run per sentence, on either side."""
    mask = torch.zeros(batch, length, dtype=torch.bool)
    if kind == "none":
        return None
    if kind == "left":  # fairseq's source side
        for b in range(1, batch):
            mask[b, : 2 * b + 1] = True
    elif kind == "right":
        for b in range(1, batch):
            mask[b, length - 2 * b - 1 :] = True
    elif kind == "mixed":  # left, right, and both sides of one sentence
        mask[0, :3] = True
        mask[1, length - 4 :] = True
        mask[2, :2] = mask[2, length - 2 :] = True
    elif kind == "long-left":  # with fewer queries than keys, padding that reaches the queries
        for b in range(1, batch):
            mask[b, : 4 * b + 1] = True
    elif kind == "empty":  # a sentence that is all padding
        mask[1, :3] = True
        mask[2] = True
    return mask


def reference(q, k, v, left, right, mask, scale):
    """Dense float64 out and lse; query i at key position i + Tk - Tq."""
    q, k, v = (t.double() for t in (q, k, v))
    batch, heads, query_length, _ = q.shape
    key_length = k.shape[2]
    allowed = dense_allowed(batch, heads, key_length, list(left), list(right), mask)
    allowed = allowed[:, :, key_length - query_length :]
    logits = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(logits, -1)
    weights = torch.exp(logits - lse.masked_fill(torch.isinf(lse), 0)[..., None])
    return weights.masked_fill(~allowed, 0) @ v, lse


def real_query_rows(mask, batch, query_length, key_length):
    if mask is None:
        return torch.ones(batch, query_length, dtype=torch.bool)
    return ~mask[:, key_length - query_length :]


def check_against_reference(q, k, v, left, right, mask, out_tol=1e-9, grad_tol=2e-6, lse_tol=2e-6,
                            **tol):  # fmt: skip
    """Outputs, lse and the three gradients on the real query rows; zeros and -inf on the
    padded ones (their upstream gradient zero in the reference, which gives them none)."""
    batch, heads, query_length, _ = q.shape
    key_length = k.shape[2]
    out, lse = cudnn_band.cudnn_band_attention(q, k, v, left, right, mask, SCALE, 0.0)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    real = real_query_rows(mask, batch, query_length, key_length)[:, None, :]
    leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    cpu_mask = None if mask is None else mask.cpu()
    expected, expected_lse = reference(*leaves, left, right, cpu_mask, SCALE)
    real_cpu = real.cpu()
    got = out.detach().double().cpu()
    torch.testing.assert_close(got[real_cpu.expand_as(got[..., 0])],
                               expected[real_cpu.expand_as(expected[..., 0])],
                               atol=out_tol, rtol=out_tol)  # fmt: skip
    assert (got[~real_cpu.expand_as(got[..., 0])] == 0).all()
    got_lse = lse.detach().double().cpu()
    torch.testing.assert_close(got_lse[real_cpu.expand_as(got_lse)],
                               expected_lse[real_cpu.expand_as(got_lse)], atol=lse_tol,
                               rtol=lse_tol)  # fmt: skip
    assert torch.isneginf(got_lse[~real_cpu.expand_as(got_lse)]).all()
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).double()
    upstream = upstream * real_cpu[..., None]
    grads = torch.autograd.grad(out, (q, k, v), upstream.to(out.device, out.dtype))
    expected_grads = torch.autograd.grad(expected, leaves, upstream)
    for got_grad, want in zip(grads, expected_grads):
        torch.testing.assert_close(got_grad.double().cpu(), want, atol=grad_tol, rtol=grad_tol)
    return out, lse


# -- the matrix on the emulation -------------------------------------------------------------

PER_HEAD = ([2, 0, 2, 1], [1, 3, 1, 0])  # heads 0 and 2 share a window: a non-consecutive group

CASES = {
    "no padding": (11, 11, [2] * H, [1] * H, "none"),
    "left padding": (11, 11, [2] * H, [1] * H, "left"),
    "right padding": (11, 11, [1] * H, [2] * H, "right"),
    "padding on both sides": (11, 11, *PER_HEAD, "mixed"),
    "all-padding sentence": (11, 11, *PER_HEAD, "empty"),
    "per-head windows": (11, 11, *PER_HEAD, "none"),
    "zero windows": (11, 11, [0] * H, [0] * H, "left"),
    "windows wider than the sequence": (9, 9, [20, 8, 3, 40], [30, 2, 8, 0], "left"),
    "fewer queries than keys": (5, 12, *PER_HEAD, "none"),
    "fewer queries than keys, left padding": (5, 12, *PER_HEAD, "left"),
    "fewer queries than keys, right padding": (5, 12, [3] * H, [1] * H, "right"),
    "fewer queries than keys, padded queries": (5, 12, *PER_HEAD, "long-left"),
    "fewer queries than keys, empty sentence": (5, 12, *PER_HEAD, "empty"),
    "fewer queries than keys, padding on both sides": (5, 12, *PER_HEAD, "mixed"),
    "one query (decoding)": (1, 12, [4, 0, 20, 2], [0] * H, "left"),
    "a batch that fills its bucket": (16, 16, [3] * H, [5] * H, "none"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_the_reference(emulated, case):
    query_length, key_length, left, right, kind = CASES[case]
    q, k, v = make_qkv(B, H, query_length, key_length, D)
    check_against_reference(q, k, v, left, right, padding(kind, B, key_length))


def test_a_batch_that_fills_its_bucket_runs_without_the_padding_mask(emulated):
    """No copies and no lengths where the call's shapes are a bucket's: the graph has no
    padding mask, and q, k, v are handed over as they are."""
    q, k, v = make_qkv(4, H, 16, 16, D)
    cudnn_band.cudnn_band_attention(q, k, v, [3] * H, [5] * H, None, SCALE, 0.0)
    (spec,) = emulated.graphs
    assert not spec.padded and (spec.batch, spec.query_length) == (4, 16)
    q, k, v = make_qkv(3, H, 15, 15, D)
    cudnn_band.cudnn_band_attention(q, k, v, [3] * H, [5] * H, None, SCALE, 0.0)
    assert [spec.padded for spec in emulated.graphs] == [False, True]


@pytest.mark.parametrize("kind", ["none", "mixed", "empty"])
def test_gradients_are_the_function_derivatives(emulated, kind):
    """gradcheck (float64 finite differences, in random directions) through padding and
    per-head windows."""
    q, k, v = make_qkv(B, H, 7, 7, D, seed=3)
    mask = padding(kind, B, 7)

    def attention(q, k, v):
        return cudnn_band.cudnn_band_attention(q, k, v, *PER_HEAD, mask, SCALE, 0.0)[0]

    assert torch.autograd.gradcheck(attention, (q, k, v), atol=1e-5, fast_mode=True)


# -- dropout ---------------------------------------------------------------------------------


def _dropout_call(q, k, v, mask, seed, p=0.3):
    torch.manual_seed(seed)
    return cudnn_band.cudnn_band_attention(q, k, v, *PER_HEAD, mask, SCALE, p)


def test_dropout_same_seed_same_mask(emulated):
    q, k, v = make_qkv(B, H, 9, 9, D)
    mask = padding("left", B, 9)
    first, first_lse = _dropout_call(q, k, v, mask, seed=5)
    again, _ = _dropout_call(q, k, v, mask, seed=5)
    other, _ = _dropout_call(q, k, v, mask, seed=6)
    plain, plain_lse = cudnn_band.cudnn_band_attention(q, k, v, *PER_HEAD, mask, SCALE, 0.0)
    assert torch.equal(first, again)
    assert not torch.allclose(first, other)
    assert not torch.allclose(first, plain)
    torch.testing.assert_close(first_lse, plain_lse)  # the statistics are taken before dropout
    real = real_query_rows(mask, B, 9, 9)[:, None, :, None]
    assert (first.masked_select(~real) == 0).all()


def test_dropout_expectation_is_the_output_without_dropout(emulated):
    """Over seeds, each output's mean is the output without dropout: every element's
    deviation is within a few standard errors, and their squares average about one."""
    q, k, v = make_qkv(B, H, 9, 9, D, seed=1)
    mask = padding("mixed", B, 9)
    seeds = 200
    with torch.no_grad():
        plain, _ = cudnn_band.cudnn_band_attention(q, k, v, *PER_HEAD, mask, SCALE, 0.0)
        samples = torch.stack([_dropout_call(q, k, v, mask, seed)[0] for seed in range(seeds)])
    spread = samples.std(0) / seeds**0.5
    varying = spread > 0
    z = (samples.mean(0) - plain)[varying] / spread[varying]
    assert varying.sum() > 0.9 * real_query_rows(mask, B, 9, 9).sum() * H * D
    assert z.abs().max() < 5.5
    assert 0.7 < z.square().mean() < 1.3


def test_dropout_gradients_use_the_forward_mask(emulated):
    """The backward runs with the forward's seed and offset: gradcheck of a fixed-seed call."""
    q, k, v = make_qkv(B, H, 7, 7, D, seed=4)
    mask = padding("left", B, 7)

    def attention(q, k, v):
        return _dropout_call(q, k, v, mask, seed=11)[0]

    assert torch.autograd.gradcheck(attention, (q, k, v), atol=1e-5, fast_mode=True)


# -- the pure parts of the translation ------------------------------------------------------


def test_bounds_mapping():
    assert cudnn_band.band_bounds(2, 1, 9, 9) == (3, 1, "TOP_LEFT")
    assert cudnn_band.band_bounds(0, 0, 9, 9) == (1, 0, "TOP_LEFT")
    assert cudnn_band.band_bounds(7, 7, 9, 9) == (8, 7, "TOP_LEFT")
    assert cudnn_band.band_bounds(8, 8, 9, 9) == (None, None, "TOP_LEFT")  # unbounded sides
    assert cudnn_band.band_bounds(3, 0, 1, 10) == (4, None, "BOTTOM_RIGHT")
    assert cudnn_band.band_bounds(3, 2, 4, 10) == (4, 2, "BOTTOM_RIGHT")
    assert cudnn_band.band_bounds(9, 3, 4, 10) == (None, None, "BOTTOM_RIGHT")
    with pytest.raises(ValueError, match="cudnn-band: windows must be >= 0"):
        cudnn_band.band_bounds(-1, 2, 9, 9)


@pytest.mark.parametrize("query_length, key_length", [(6, 6), (3, 7), (1, 5)])
def test_bounds_give_the_operators_window_under_cudnns_rule(query_length, key_length):
    """For every window, the scores cuDNN keeps with the mapped bounds (the emulation's band
    rule) are exactly the keys p - L .. p + R of query i at p = i + Tk - Tq."""
    lengths_q, lengths_kv = torch.tensor([query_length]), torch.tensor([key_length])
    position = torch.arange(query_length)[:, None] + key_length - query_length
    key = torch.arange(key_length)[None, :]
    for left in range(key_length + 1):
        for right in range(key_length + 1):
            left_bound, right_bound, alignment = cudnn_band.band_bounds(
                left, right, query_length, key_length
            )
            kept = emulator.kept_scores(1, query_length, key_length,
                                        getattr(emulator.diagonal_alignment, alignment),
                                        left_bound, right_bound, lengths_q, lengths_kv,
                                        padding=False)  # fmt: skip
            wanted = (key >= position - left) & (key <= position + right)
            assert torch.equal(kept[0, 0], wanted), (left, right)


def test_bucket_sizes():
    assert [cudnn_band.bucket_size(n) for n in (1, 2, 3, 5, 8, 9, 10, 17, 100, 1000, 1025)] == [
        1, 2, 3, 5, 8, 10, 10, 20, 112, 1024, 1280,
    ]  # fmt: skip
    assert cudnn_band.bucket_size(3, smallest=16) == 16
    for n in range(1, 5000):
        size = cudnn_band.bucket_size(n)
        assert n <= size <= max(n * 1.25, 4)
        assert cudnn_band.bucket_size(size) == size


def test_window_groups():
    groups = cudnn_band.window_groups(*PER_HEAD)
    assert [(g.left, g.right, g.heads) for g in groups] == [(2, 1, (0, 2)), (0, 3, (1,)),
                                                            (1, 0, (3,))]  # fmt: skip
    x = torch.arange(2 * H).view(1, H, 2, 1)
    assert torch.equal(groups[0].select(x, H), x[:, [0, 2]])
    (whole,) = cudnn_band.window_groups([1] * H, [2] * H)
    assert whole.select(x, H) is x


# -- the graph cache -------------------------------------------------------------------------


def test_batches_in_one_bucket_share_their_graphs(emulated):
    """fairseq's changing batch shapes: (9, 17) and (10, 19) are both bucket (10, 20), so the
    second batch builds nothing; a third shape in another bucket builds its own."""
    cudnn_band.clear_graph_cache()
    for batch, length in ((9, 17), (10, 19)):
        q, k, v = make_qkv(batch, H, length, length, D)
        out, _ = cudnn_band.cudnn_band_attention(q, k, v, *PER_HEAD, None, SCALE, 0.0)
        out.sum().backward()
    groups = len(cudnn_band.window_groups(*PER_HEAD))
    assert cudnn_band.cached_graph_count() == 2 * groups  # a forward and a backward graph each
    assert len(emulated.build_seconds) == 2 * groups
    q, k, v = make_qkv(11, H, 20, 20, D)
    cudnn_band.cudnn_band_attention(q, k, v, *PER_HEAD, None, SCALE, 0.0)
    assert cudnn_band.cached_graph_count() == 3 * groups


def test_the_graph_cache_is_bounded(monkeypatch):
    library = cudnn_band.Frontend(emulator, cache_size=2)
    monkeypatch.setattr(cudnn_band, "_library", library)
    q, k, v = make_qkv(2, 1, 8, 8, D)
    for window in range(4):
        cudnn_band.cudnn_band_attention(q, k, v, [window], [1], None, SCALE, 0.0)
        assert cudnn_band.cached_graph_count() == min(window + 1, 2)
    assert len(library.build_seconds) == 4
    cudnn_band.cudnn_band_attention(q, k, v, [3], [1], None, SCALE, 0.0)  # still cached
    assert len(library.build_seconds) == 4
    cudnn_band.cudnn_band_attention(q, k, v, [0], [1], None, SCALE, 0.0)  # evicted: rebuilt
    assert len(library.build_seconds) == 5


def test_a_refused_graph_is_one_error_naming_the_route(emulated):
    """The frontend's refusal of a graph (here a left bound of 0 in the backward, which the
    route never asks for) comes back as one RuntimeError naming the route."""
    spec = cudnn_band.GraphSpec(
        backward=True, dtype=torch.float64, device=torch.device("cpu"), batch=2, heads=1,
        query_length=16, key_length=16, head_dim=D, left_bound=0, right_bound=1,
        alignment="TOP_LEFT", padded=False, scale=SCALE, dropout_p=0.0, deterministic=False,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match=r"^cudnn-band: cuDNN cannot build the backward graph"):
        cudnn_band._build(emulator, emulator.create_handle(), spec)


# -- second derivatives ----------------------------------------------------------------------


def test_second_derivatives_are_refused_by_name(emulated):
    """First derivatives under create_graph are the plain ones; a gradient of them is one
    error naming the route."""
    q, k, v = make_qkv(2, H, 7, 7, D)
    mask = padding("left", 2, 7)

    def loss():
        return cudnn_band.cudnn_band_attention(q, k, v, *PER_HEAD, mask, SCALE, 0.0)[0].sin().sum()

    plain = torch.autograd.grad(loss(), (q, k, v))
    with_graph = torch.autograd.grad(loss(), (q, k, v), create_graph=True)
    for got, expected in zip(with_graph, plain):
        torch.testing.assert_close(got, expected)
    penalty = sum(g.square().sum() for g in with_graph)
    with pytest.raises(RuntimeError, match="^cudnn-band: second derivatives.*"
                                           "LOCAL_ATTN_BANDED_IMPL=torch"):  # fmt: skip
        torch.autograd.grad(penalty, (q, k, v))


# -- what the route takes --------------------------------------------------------------------


def _call_args(dtype=torch.bfloat16, dim=64, query_length=8, key_length=8, window=2):
    q, k, v = make_qkv(2, 2, query_length, key_length, dim, dtype=dtype)
    return q, k, v, [window, 1], [1, window]


def test_unsupported_reasons_on_this_machine(emulated):
    """With the library present, a bfloat16 D = 64 call on the CPU lacks only a CUDA device."""
    q, k, v, left, right = _call_args()
    assert cudnn_band.unsupported_reasons(q, k, v, left, right, None, 0.1) == [
        "it runs on CUDA devices only, not cpu"
    ]


def test_unsupported_reasons_name_what_is_missing(emulated):
    def reasons(*args, dropout_p=0.0, mask=None):
        return " | ".join(cudnn_band.unsupported_reasons(*args, mask, dropout_p))

    assert "float16 and bfloat16, not float32" in reasons(*_call_args(torch.float32))
    assert "not float64" in reasons(*_call_args(torch.float64))
    assert "multiples of 8 up to 128, not 12" in reasons(*_call_args(dim=12))
    assert "not 256" in reasons(*_call_args(dim=256))
    assert "windows >= 0" in reasons(*_call_args(window=-1))
    assert "no more queries than keys, not 9 > 8" in reasons(*_call_args(query_length=9))
    assert "dropout with fewer queries than keys" in reasons(*_call_args(query_length=3),
                                                             dropout_p=0.1)  # fmt: skip
    assert "fewer queries" not in reasons(*_call_args(query_length=3))
    assert "dropout_p = 1" in reasons(*_call_args(), dropout_p=1.0)


def test_unsupported_reasons_without_the_library(monkeypatch):
    monkeypatch.setattr(cudnn_band, "FRONTEND_MODULE", "cudnn_frontend_that_is_not_installed")
    monkeypatch.setattr(cudnn_band, "_library", cudnn_band.Frontend())
    q, k, v, left, right = _call_args()
    first = cudnn_band.unsupported_reasons(q, k, v, left, right, None, 0.0)[0]
    assert first.startswith("nvidia-cudnn-frontend is not importable")
    assert "pip install local_attn_fairseq[cudnn]" in first
    with pytest.raises(RuntimeError, match=r"^cudnn-band: nvidia-cudnn-frontend cannot be "
                                           r"imported.*pip install local_attn_fairseq\[cudnn\]"):
        cudnn_band.cudnn_band_attention(q, k, v, left, right, None, SCALE, 0.0)


def test_old_backends_and_old_gpus_are_refused(monkeypatch):
    class OldBackend:
        @staticmethod
        def backend_version():
            return 90600

    monkeypatch.setattr(cudnn_band, "_library", cudnn_band.Frontend(OldBackend))
    q, k, v, left, right = _call_args()
    assert "cuDNN 9.10.2 or newer, found 90600" in cudnn_band.unsupported_reasons(
        q, k, v, left, right, None, 0.0
    )[0]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert cudnn_band.device_reasons(torch.device("cuda", 0)) == [
        "it needs a GPU of compute capability 8.0 or newer"
    ]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert cudnn_band.device_reasons(torch.device("cuda", 0)) == []


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(left=[-1, 2]), "windows must be >= 0"),
        (dict(left=[1, 2, 3]), "left gives 3 windows for 2 heads"),
        (dict(query_length=9), r"more queries \(9\) than keys \(8\)"),
        (dict(query_length=4, dropout_p=0.1), "dropout with fewer queries than keys"),
        (dict(dropout_p=1.0), r"dropout_p must be in \[0, 1\)"),
        (dict(mask=torch.zeros(2, 7, dtype=torch.bool)), "key_padding_mask must be bool"),
    ],
)
def test_calls_it_cannot_take_are_one_line_errors(emulated, change, message):
    q, k, v = make_qkv(2, 2, change.get("query_length", 8), 8, D)
    args = dict(left=[1, 2], right=[2, 1], mask=None, dropout_p=0.0)
    args.update({key: value for key, value in change.items() if key != "query_length"})
    with pytest.raises(ValueError, match=f"^cudnn-band: {message}"):
        cudnn_band.cudnn_band_attention(q, k, v, args["left"], args["right"], args["mask"], SCALE,
                                        args["dropout_p"])  # fmt: skip


def test_the_installed_frontend_is_the_emulated_one():
    """setup.py's extra and scripts/setup_env.sh install the frontend version the emulation
    was written from."""
    assert cudnn_band.FRONTEND_REQUIREMENT == f"nvidia-cudnn-frontend=={emulator.__version__}"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for path in ("setup.py", "scripts/setup_env.sh"):
        with open(os.path.join(root, path)) as f:
            assert cudnn_band.FRONTEND_REQUIREMENT in f.read(), path


# -- the emulation's own contract (written from the frontend's documentation) ----------------


def _emulated_forward(q, k, v, **options):
    graph = emulator.pygraph(io_data_type=emulator.data_type.DOUBLE, handle=1)
    tensors = [graph.tensor(name=n, dim=list(t.shape), stride=list(t.stride()), uid=i + 1)
               for i, (n, t) in enumerate(zip("qkv", (q, k, v)))]  # fmt: skip
    o, stats = graph.sdpa(*tensors, generate_stats=True, **options)
    o.set_uid(10).set_output(True)
    stats.set_uid(11).set_output(True)
    graph.build([emulator.heur_mode.A])
    out = torch.empty_like(q)
    lse = torch.empty(*q.shape[:3], 1, dtype=torch.float32)
    workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8)
    graph.execute({tensors[0]: q, tensors[1]: k, tensors[2]: v, o: out, stats: lse}, workspace)
    return out, lse


def test_emulation_without_masks_is_softmax_attention():
    q, k, v = (t.detach() for t in make_qkv(2, 2, 5, 7, D))
    out, lse = _emulated_forward(q, k, v, attn_scale=0.5)
    logits = q @ k.transpose(-1, -2) * 0.5
    torch.testing.assert_close(out, logits.softmax(-1) @ v)
    torch.testing.assert_close(lse[..., 0], logits.logsumexp(-1).float())


@pytest.mark.parametrize(
    "options, refusal",
    [
        (dict(diagonal_band_right_bound=-1), "Right bound needs to be larger"),
        (dict(diagonal_band_right_bound=0, dropout=(0.1,)), "dropout must be a tuple"),
        (dict(attn_scale=1), "attn_scale must be a cudnn_tensor or float"),
        (dict(diagonal_band_left_bound=2.0), "diagonal_band_left_bound must be an int"),
    ],
)
def test_emulation_refuses_what_the_frontend_refuses(options, refusal):
    q, k, v = (t.detach() for t in make_qkv(1, 1, 4, 4, D))
    with pytest.raises(Exception, match=refusal):
        _emulated_forward(q, k, v, **options)


def test_emulation_refuses_bottom_right_bands_with_dropout():
    graph = emulator.pygraph(io_data_type=emulator.data_type.DOUBLE)
    q, k, v = (graph.tensor(name=n, dim=[1, 1, 4, D], stride=[4 * D, 4 * D, D, 1]) for n in "qkv")
    seed, offset = (graph.tensor(dim=[1, 1, 1, 1], data_type=emulator.data_type.INT64)
                    for _ in range(2))  # fmt: skip
    graph.sdpa(q, k, v, generate_stats=True, dropout=(0.1, seed, offset),
               diagonal_alignment=emulator.diagonal_alignment.BOTTOM_RIGHT,
               diagonal_band_right_bound=0)  # fmt: skip
    with pytest.raises(emulator.cudnnGraphNotSupportedError, match="Bottom right"):
        graph.validate()


# -- the real library on a GPU ---------------------------------------------------------------

needs_frontend_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or cudnn_band._library.module() is None,
    reason="needs a CUDA device and nvidia-cudnn-frontend",
)
GPU_TOLERANCE = {torch.bfloat16: 4e-2, torch.float16: 1e-2}


@needs_frontend_gpu
class TestCudaFrontend:
    """The real frontend against the dense reference, and its costs."""

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("dim", [32, 64, 128])
    @pytest.mark.parametrize("case", ["no padding", "left padding", "all-padding sentence",
                                      "per-head windows", "fewer queries than keys, left padding",
                                      "windows wider than the sequence"])  # fmt: skip
    def test_matches_the_reference(self, dtype, dim, case):
        query_length, key_length, left, right, kind = CASES[case]
        scale = 4  # lengths that are not multiples of the kernels' tiles
        q, k, v = make_qkv(B, H, query_length * scale, key_length * scale, dim, dtype=dtype,
                           device="cuda")  # fmt: skip
        mask = padding(kind, B, key_length * scale)
        mask = None if mask is None else mask.cuda()
        tol = GPU_TOLERANCE[dtype]
        check_against_reference(q, k, v, [w * scale for w in left], [w * scale for w in right],
                                mask, out_tol=tol, grad_tol=tol, lse_tol=1e-2)  # fmt: skip

    def test_dropout_same_seed_same_output(self):
        q, k, v = make_qkv(B, H, 64, 64, 64, dtype=torch.bfloat16, device="cuda")
        mask = padding("left", B, 64).cuda()
        first, first_lse = _dropout_call(q, k, v, mask, seed=3)
        again, _ = _dropout_call(q, k, v, mask, seed=3)
        other, _ = _dropout_call(q, k, v, mask, seed=4)
        plain, plain_lse = cudnn_band.cudnn_band_attention(q, k, v, *PER_HEAD, mask, SCALE, 0.0)
        assert torch.equal(first, again) and not torch.equal(first, other)
        torch.testing.assert_close(first_lse, plain_lse)
        first.float().sum().backward()  # the backward graph with the forward's seed

    def test_deterministic_backward(self):
        q, k, v = make_qkv(B, H, 256, 256, 64, dtype=torch.bfloat16, device="cuda")
        torch.use_deterministic_algorithms(True)
        try:
            runs = [torch.autograd.grad(cudnn_band.cudnn_band_attention(
                q, k, v, [32] * H, [32] * H, None, SCALE, 0.0)[0].float().sum(), (q, k, v))
                for _ in range(2)]  # fmt: skip
        finally:
            torch.use_deterministic_algorithms(False)
        for first, second in zip(*runs):
            assert torch.equal(first, second)

    def test_build_and_host_time(self):
        """Records a graph's build time and the host time of a call (its launches, no
        synchronisation) at B = 8, H = 8, T = 1024, D = 64, w = 129, bfloat16; written to
        $CUDNN_BAND_TIMINGS_JSON when set."""
        cudnn_band.clear_graph_cache()
        built_before = len(cudnn_band._library.build_seconds)
        q, k, v = make_qkv(8, 8, 1024, 1024, 64, dtype=torch.bfloat16, device="cuda")
        args = (q, k, v, [64] * 8, [64] * 8, None, 64**-0.5, 0.0)
        out, _ = cudnn_band.cudnn_band_attention(*args)
        out.float().sum().backward()
        torch.cuda.synchronize()
        builds = cudnn_band._library.build_seconds[built_before:]
        forward_host, step_host = [], []
        for _ in range(30):
            start = time.perf_counter()
            out, _ = cudnn_band.cudnn_band_attention(*args)
            forward_host.append(time.perf_counter() - start)
            loss = out.float().sum()
            start = time.perf_counter()
            loss.backward()
            step_host.append(time.perf_counter() - start)
            torch.cuda.synchronize()
        record = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "frontend": getattr(cudnn_band._library.module(), "__version__", "?"),
            "cudnn_backend": cudnn_band._library.module().backend_version(),
            "graph_build_ms": [round(s * 1e3, 2) for s in builds],
            "forward_host_us_median": round(statistics.median(forward_host) * 1e6, 1),
            "backward_host_us_median": round(statistics.median(step_host) * 1e6, 1),
        }
        print("cudnn-band timings:", json.dumps(record))
        if os.environ.get("CUDNN_BAND_TIMINGS_JSON"):
            with open(os.environ["CUDNN_BAND_TIMINGS_JSON"], "w") as f:
                json.dump(record, f, indent=1)
        assert len(builds) == 2  # one forward and one backward graph
