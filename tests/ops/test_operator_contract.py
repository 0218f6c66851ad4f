"""Every operator under torch.ops.local_attn against PyTorch's custom-operator contract
(torch.library.opcheck: schema, autograd registration, fake tensors, AOT dispatch), and second
derivatives: computed correctly (gradgradcheck, float64) where PyTorch's operations compute them,
refused with one error naming the operator and the route that computes them where the compiled
kernels would give wrong ones."""

import functools
import importlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from local_attn_fairseq.locality.spec import HeadSpec
from local_attn_fairseq.modules.attention_plan import PANDE_BAND_MIN_KEYS, Path
from local_attn_fairseq.modules.local_multihead_attention import LocalMultiheadAttention
from local_attn_fairseq.ops import band_with_global_lse, extension_info, mechanisms

from .test_banded_attention import _forward_samples, make_padding, make_qkv
from .test_mechanisms import (
    B, H, HEADS, S, gaussian_parameters, local_scores, module, padding, window_case,
)  # fmt: skip

banded_module = importlib.import_module("local_attn_fairseq.ops.banded_attention")

pytestmark = pytest.mark.skipif(
    not (extension_info()["loaded"] and mechanisms.cpu_operators_apply(torch.zeros(1))),
    reason="extension not built",
)

# Operators whose only kernels are CUDA ones (their GPU tests run opcheck on them).
CUDA_ONLY = {"banded_forward_tensor_core", "banded_backward_tensor_core"}


def _detached(args):
    return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)


def _gaussian_args(tgt, given_window):
    query, w_p, u_p, u_d, window = gaussian_parameters(tgt, given_window)
    real = (~padding(B, S)).double()
    seen = real.sum(-1, keepdim=True).expand(-1, tgt)
    return (query, w_p, u_p, u_d, seen - 1, seen, real.cumsum(-1) - 1, window)


def _attention_args(tgt):
    dbl = dict(dtype=torch.float64, requires_grad=True)
    q = torch.randn(B, H, tgt, 3, **dbl)
    k, v = torch.randn(B, H, S, 3, **dbl), torch.randn(B, H, S, 3, **dbl)
    return q, k, v


def mechanism_samples():
    """Arguments of each mechanism operator, in the order of its schema: with every optional
    term present once and absent once, padding, segments and dropout."""
    inputs, window_args, key_padding_mask, tgt = window_case(2, True, False)
    window = tuple(inputs(*window_args))
    local_w, local_keys, local_b = local_scores(tgt, True)
    q, k, v = _attention_args(tgt)
    keep = torch.rand(B, H, tgt, S, generator=torch.Generator().manual_seed(0)) >= 0.3
    padded = (None, key_padding_mask, keep, 0.7, 0.3)
    plain = (None, None, None, 0.7, 0.0)
    dbl = dict(dtype=torch.float64, requires_grad=True)
    bias = torch.randn(B, H, tgt, S, **dbl)
    multiplier = torch.rand(B, H, tgt, S, **dbl) * 2
    by_queries, by_windows = _gaussian_args(tgt, False), _gaussian_args(tgt, True)
    return {
        "gaussian_localness": [(*by_queries, bias, 0.1, 1e-4), (*by_windows, None, 0.0, 0.5)],
        "dynamic_window_mask": [window],
        "additive_window_term": [(*window, local_w, local_b, local_keys, 0.3),
                                 (*window, local_w, None, local_keys, 0.3)],
        "dense_attention": [(q, k, v, bias, multiplier, *padded), (q, k, v, None, None, *plain)],
        "gaussian_attention": [(q, k, v, *by_queries, 0.1, 1e-4, bias, None, *padded),
                               (q, k, v, *by_windows, 0.0, 0.5, None, multiplier, *plain)],
        "window_attention": [(q, k, v, *window, local_w, local_b, local_keys, 0.3, bias, None,
                              *padded),
                             (q, k, v, *window, None, None, None, 0.0, None, multiplier,
                              *plain)],
    }  # fmt: skip


def band_samples():
    forward = _forward_samples()
    backward = []
    for args in forward:
        out, lse = torch.ops.local_attn.banded_forward(*_detached(args))
        grad = torch.randn_like(out)
        backward.append((grad, *_detached(args[:3]), out, lse, *args[3:]))
    return {"banded_forward": forward, "banded_backward": backward}


def projection_samples():
    x = torch.randn(5, 3, 7, dtype=torch.float64, requires_grad=True)
    weights = [torch.randn(n, 7, dtype=torch.float64, requires_grad=True) for n in (8, 4)]
    biases = [torch.randn(8, dtype=torch.float64, requires_grad=True), None]
    return {"project_heads": [(x, weights, biases, 4)]}


def all_samples():
    samples = {**mechanism_samples(), **band_samples(), **projection_samples()}
    for name, cases in mechanism_samples().items():
        op = getattr(torch.ops.local_attn, name)
        grads = [torch.randn_like(_first(op(*_detached(args)))) for args in cases]
        samples[f"{name}_backward"] = [
            (grad, *_detached(args)) for grad, args in zip(grads, cases)
        ]
    return samples


def _first(outputs):
    return outputs[0] if isinstance(outputs, (tuple, list)) else outputs


def registered_operators():
    mechanisms.register_fake_kernels()
    prefix = "local_attn::"
    names = torch._C._dispatch_get_all_op_names()
    return sorted(n[len(prefix) :] for n in names if n.startswith(prefix))


def test_every_registered_operator_is_checked():
    """A new operator cannot miss the contract: each one has samples here (or is CUDA-only)."""
    assert set(registered_operators()) == set(all_samples()) | CUDA_ONLY


@pytest.mark.parametrize("name", sorted(set(registered_operators()) - CUDA_ONLY))
def test_opcheck(name):
    op = getattr(torch.ops.local_attn, name).default
    for args in all_samples()[name]:
        torch.library.opcheck(op, args)
        if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            torch.library.opcheck(op, _detached(args))


@pytest.mark.parametrize("layout, causal", [("gaussian", True), ("mw", False), ("aw", True),
                                            ("aw-seg2 and gaussian", False)])
def test_torch_compile_traces_the_operators_of_a_layer(layout, causal):
    """torch.compile traces a layer's C++ operators (their fake kernels), not PyTorch's
    compositions, with the outputs and gradients of eager, padding and an empty sentence
    included."""
    torch._dynamo.reset()
    attn = module(layout, causal).train()
    x = torch.randn(6, 3, attn.embed_dim, requires_grad=True)
    pad = padding(3, 6, [(0, slice(0, 2)), (2, slice(None))])
    future = torch.triu(torch.full((6, 6), float("-inf")), 1) if causal else None
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(str(graph_module.graph))
        return graph_module.forward

    def layer(x):
        return attn(x, x, x, key_padding_mask=pad, need_weights=False, attn_mask=future)[0]

    leaves = [x, *attn.parameters()]
    eager = layer(x)
    eager_grads = torch.autograd.grad(eager.square().sum(), leaves, allow_unused=True)
    compiled = torch.compile(layer, backend=recording_backend)(x)
    compiled_grads = torch.autograd.grad(compiled.square().sum(), leaves, allow_unused=True)
    traced = " ".join(graphs)
    assert "local_attn.project_heads" in traced
    assert any(f"local_attn.{name}" in traced for name in mechanism_samples())
    torch.testing.assert_close(compiled, eager)
    for got, expected in zip(compiled_grads, eager_grads):
        if expected is None:
            assert got is None
        else:
            torch.testing.assert_close(got, expected)


# -- second derivatives ---------------------------------------------------------------------------

REFUSING = {
    name: "LOCAL_ATTN_MECHANISM_IMPL=torch" for name in mechanism_samples()
} | {"banded_forward": "LOCAL_ATTN_BANDED_IMPL=torch"}


@pytest.mark.parametrize("name", sorted(REFUSING))
def test_compiled_operators_refuse_second_derivatives(name):
    """First derivatives under create_graph are the plain ones (a gradient penalty's first step
    needs them); a gradient of them is one error naming the operator and the route that
    computes it, never a silent zero."""
    op = getattr(torch.ops.local_attn, name)
    for args in all_samples()[name]:
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        plain = torch.autograd.grad(_first(op(*args)).square().sum(), leaves)
        with_graph = torch.autograd.grad(
            _first(op(*args)).square().sum(), leaves, create_graph=True
        )
        for got, expected in zip(with_graph, plain):
            torch.testing.assert_close(got, expected)
        penalty = sum(g.square().sum() for g in with_graph)
        with pytest.raises(RuntimeError, match=f"local_attn::{name}: second derivatives.*"
                                                f"{REFUSING[name]}"):  # fmt: skip
            torch.autograd.grad(penalty, leaves)


@pytest.mark.parametrize("name", sorted(set(mechanism_samples()) | {"banded_forward"}))
def test_traced_calls_refuse_second_derivatives_too(name):
    """The fake-tensor path of the Autograd kernels (csrc/operator_autograd.h) gives first
    derivatives under create_graph and refuses second ones, as the eager path does."""
    op = getattr(torch.ops.local_attn, name)
    real = all_samples()[name][0]
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(a).requires_grad_(a.requires_grad)
                if isinstance(a, torch.Tensor) else a for a in real]  # fmt: skip
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        grads = torch.autograd.grad(_first(op(*args)).square().sum(), leaves, create_graph=True)
        assert [g.shape for g in grads] == [a.shape for a in leaves]
        with pytest.raises(RuntimeError, match=f"local_attn::{name}: second derivatives"):
            torch.autograd.grad(sum(g.square().sum() for g in grads), leaves)


def test_project_heads_second_derivatives():
    """Its backward is made of ATen products, which autograd differentiates."""
    x, weights, biases, head_dim = projection_samples()["project_heads"][0]

    def project(x, w0, w1, b0):
        return mechanisms.project_heads(x, [(w0, b0), (w1, None)], head_dim)

    assert torch.autograd.gradgradcheck(project, (x, *weights, biases[0]))


@pytest.mark.parametrize("pad", ["none", "empty_row"])
def test_torch_route_second_derivatives(pad):
    """LOCAL_ATTN_BANDED_IMPL=torch, the route the refusal names: padding, a sentence that is
    all padding, dropout's mask, per-head windows."""
    q, k, v = make_qkv(2, 2, 7, 3)
    key_padding_mask = make_padding(pad, 2, 7)
    keep = torch.rand(2, 2, 7, 5, generator=torch.Generator().manual_seed(1)) >= 0.3

    def attention(q, k, v):
        args = (q, k, v, [2, 0], [1, 2], key_padding_mask, keep, 0.6, 0.3)
        return banded_module._TorchBandedAttention.apply(*args)[0]

    assert torch.autograd.gradgradcheck(attention, (q, k, v))


def test_banded_attention_second_derivatives_on_the_torch_route(monkeypatch):
    """The issue's case: a Hessian-vector product through banded_attention, on the route the
    refusal names, equals that of the same attention written densely."""
    monkeypatch.setenv("LOCAL_ATTN_BANDED_IMPL", "torch")
    q, k, v = make_qkv(1, 2, 9, 4)
    allowed = (torch.arange(9)[:, None] - torch.arange(9)[None, :]).abs() <= 2

    def dense(q, k, v):
        logits = (q @ k.transpose(-1, -2) / 2).masked_fill(~allowed, float("-inf"))
        return logits.softmax(-1) @ v

    def hessian_vector(attention):
        grads = torch.autograd.grad(attention(q, k, v).sin().sum(), (q, k, v), create_graph=True)
        return torch.autograd.grad(sum(g.square().sum() for g in grads), (q, k, v))

    band = hessian_vector(lambda q, k, v: banded_module.banded_attention(q, k, v, 2, 2))
    expected = hessian_vector(dense)
    assert expected[0].norm() > 0.1
    for got, want in zip(band, expected):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("causal, block_rows", [(False, None), (True, None), (False, 2)])
def test_all_keys_logsumexp_second_derivatives(causal, block_rows):
    """On PyTorch's flash attention (the CPU's default) and per block of queries alike; a
    sentence that is all padding gives -inf rows and zero gradients."""
    q, k, _ = make_qkv(2, 2, 6, 3)
    key_padding_mask = make_padding("empty_row", 2, 6)

    def lse(q, k):
        out = band_with_global_lse.all_keys_logsumexp(
            q, k, 0.7, key_padding_mask, causal, block_rows
        )
        return out.masked_fill(torch.isneginf(out), 0.0)

    assert torch.autograd.gradgradcheck(lse, (q, k))


@pytest.mark.parametrize("route", ["extension", "torch"])
def test_band_of_full_softmax_second_derivatives(monkeypatch, route):
    """Pande's masks after a full softmax: prev-k and next-k (shifted keys), a band, padding."""
    monkeypatch.setenv("LOCAL_ATTN_BANDED_IMPL", route)
    q, k, v = make_qkv(2, 3, 6, 3)
    key_padding_mask = make_padding("empty_row", 2, 6)

    def attention(q, k, v):
        return band_with_global_lse.band_of_full_softmax(
            q, k, v, [(-1, -1), (2, 2), (-1, 1)], key_padding_mask
        )

    assert torch.autograd.gradgradcheck(attention, (q, k, v))


def mechanism_layer_in_float64(layout, x, params):
    """The self-attention layer of ``module(layout)`` (no padding, not causal, no dropout) as the
    papers write it, in float64: ``params`` are its parameters by name. MW (Nguyen et al. Eq. 13):
    softmax(qk^T / sqrt(d)) * M; AW (Eqs. 14-16): softmax(qk^T / sqrt(d) + s_loc * M); Gaussian
    (Yang et al. Eqs. 6-9, the query strategy): softmax(qk^T / sqrt(d) - 2 (j - P)^2 / D^2)."""
    tgt, bsz, dim = x.shape
    heads = HEADS
    head_dim = dim // heads

    def linear(name, width=heads):  # x W^T + b, split into `width` heads (bsz, width, tgt, d)
        y = x @ params[f"{name}.weight"].t()
        if f"{name}.bias" in params:
            y = y + params[f"{name}.bias"]
        return y.view(tgt, bsz, width, head_dim).permute(1, 2, 0, 3)

    q, k, v = linear("q_proj"), linear("k_proj"), linear("v_proj")
    logits = q @ k.transpose(-1, -2) / head_dim**0.5
    if layout in ("mw", "aw"):  # Eqs. 7-9: pointers phi_l, phi_r and the soft window M
        pointer_q = linear("dynamic_windows.0.query_pointers", 2 * heads) / head_dim**0.5
        pointer_k = linear("dynamic_windows.0.key_pointers", 2 * heads)
        phi_l, phi_r = (pointer_q @ pointer_k.transpose(-1, -2)).softmax(-1).chunk(2, dim=1)

        def at_most(phi):  # P(pointer <= j), and P(pointer >= j) below
            return phi.cumsum(-1)

        def at_least(phi):
            return phi.flip(-1).cumsum(-1).flip(-1)

        window = at_most(phi_l) * at_least(phi_r) + at_most(phi_r) * at_least(phi_l)
    if layout == "aw":
        local_scores = linear("local_q_proj") @ linear("local_k_proj").transpose(-1, -2)
        logits = logits + local_scores / head_dim**0.5 * window
    if layout == "gaussian":
        query = (x @ params["q_proj.weight"].t() + params["q_proj.bias"]).transpose(0, 1)
        hidden = torch.tanh(query @ params["localness.w_p.weight"].t())
        length = float(tgt)  # I: every key is real
        centre = length * torch.sigmoid(hidden @ params["localness.u_p.weight"].t())
        width = length * torch.sigmoid(hidden @ params["localness.u_d.weight"].t())
        centre, width = centre.transpose(1, 2)[..., None], width.transpose(1, 2)[..., None]
        position = torch.arange(tgt, dtype=x.dtype)
        logits = logits - 2 * (position - centre).square() / width.square()
    probs = logits.softmax(-1)
    if layout == "mw":
        probs = probs * window
    out = (probs @ v).permute(2, 0, 1, 3).reshape(tgt, bsz, dim)
    return out @ params["out_proj.weight"].t() + params["out_proj.bias"]


def gradient_penalty_gradients(layer, x, params):
    """d/d(x, params) of a gradient penalty: sum of the squared gradients of sum(sin(layer))."""
    leaves = [x, *params]
    grads = torch.autograd.grad(layer(x, params).sin().sum(), leaves, create_graph=True)
    return torch.autograd.grad(sum(g.square().sum() for g in grads), leaves)


def assert_second_derivatives_as_written_out(second, attn, x, written_out):
    """``second`` (a float32 layer's gradient_penalty_gradients over x and its parameters)
    equals the penalty's gradients through ``written_out(x, {name: parameter})`` in float64,
    within 1e-5 of the largest entry (float32 is off by ~1e-7 of it)."""
    names = [name for name, p in attn.named_parameters() if p.requires_grad]
    params = [p for p in attn.parameters() if p.requires_grad]
    leaves = [t.detach().double().requires_grad_(True) for t in (x, *params)]

    def layer(x, params):
        return written_out(x, dict(zip(names, params)))

    expected = gradient_penalty_gradients(layer, leaves[0], leaves[1:])
    assert expected[0].norm() > 0.1
    largest = max(want.abs().max().item() for want in expected)
    for name, got, want in zip(["x", *names], second, expected):
        torch.testing.assert_close(
            got.double(), want, rtol=1e-4, atol=1e-5 * largest, msg=lambda m: f"{name}: {m}"
        )


@pytest.mark.parametrize("layout", ["mw", "aw", "gaussian"])
def test_a_layer_of_mechanism_heads_refuses_or_computes_second_derivatives(monkeypatch, layout):
    """The issue's case: a gradient penalty through a layer of MW, AW or Gaussian heads. On the
    C++ operators it is refused by name; with LOCAL_ATTN_MECHANISM_IMPL=torch it is computed,
    and equals the same penalty's gradients through the layer written out in float64."""
    attn = module(layout)
    params = [p for p in attn.parameters() if p.requires_grad]
    x = torch.randn(5, 2, attn.embed_dim, generator=torch.Generator().manual_seed(3))
    x.requires_grad_(True)

    def layer(x, params):
        return attn(x, x, x, need_weights=False)[0]

    with pytest.raises(RuntimeError, match="second derivatives.*LOCAL_ATTN_MECHANISM_IMPL=torch"):
        gradient_penalty_gradients(layer, x, params)
    monkeypatch.setenv("LOCAL_ATTN_MECHANISM_IMPL", "torch")
    second = gradient_penalty_gradients(layer, x, params)
    assert_second_derivatives_as_written_out(
        second, attn, x, functools.partial(mechanism_layer_in_float64, layout)
    )


def test_a_layer_of_local_heads_second_derivatives_are_right(monkeypatch):
    """gradgradcheck through a layer of local heads on the PyTorch route, in float64 (the
    mechanisms' dense path takes its softmax in float32, as fairseq's attention does, so a
    float64 check of it would measure float32 rounding)."""
    monkeypatch.setenv("LOCAL_ATTN_BANDED_IMPL", "torch")
    torch.manual_seed(0)
    attn = LocalMultiheadAttention(
        8, 2, head_specs=[HeadSpec("local-1"), HeadSpec("local-2")], self_attention=True
    ).double()
    attn.bind_qk_owners([attn])
    x = torch.randn(5, 2, 8, dtype=torch.float64, requires_grad=True)
    key_padding_mask = make_padding("left", 2, 5)

    def layer(x):
        return attn(x, x, x, key_padding_mask=key_padding_mask, need_weights=False)[0]

    assert torch.autograd.gradgradcheck(layer, (x,))


# Pande's heads of a config (i) layer (every head's Q/K that of head 0), and band heads beside
# global ones, each head with its own Q/K
PANDE_LAYERS = {
    "config (i)": [HeadSpec("identity")] + [
        HeadSpec(mask, (0, 0))
        for mask in ("identity", "prev-1", "prev-2", "next-1", "next-2", "band-1", "band-2")
    ],
    "band and global": [HeadSpec(m) for m in ("band-1", "band-2", "global", "global")] * 2,
}


def path_of(attn, length):
    """The path of the layer's plan for a whole sequence of ``length`` tokens (no mask)."""
    queries = torch.empty(2, attn.num_heads, length, attn.head_dim, dtype=attn.q_proj.weight.dtype)
    return attn.plan.path(queries, queries, length, None, False)


def pande_layer(heads):
    torch.manual_seed(0)
    attn = LocalMultiheadAttention(16, 8, head_specs=heads, self_attention=True).double()
    attn.bind_qk_owners([attn])
    return attn


@pytest.mark.parametrize("layer", sorted(PANDE_LAYERS))
def test_a_layer_of_pande_band_heads_second_derivatives_are_right(monkeypatch, layer):
    """gradgradcheck in float64 through a layer of Pande's band heads at the length from which
    it takes the band path (the band of the full softmax, ops.band_with_global_lse), on the
    PyTorch route, with left padding: the layer's input moves along four random directions and
    its output is read through a fixed random projection (checking every input and output
    element would take minutes; gradgradcheck's fast_mode misses a backward that autograd
    cannot differentiate)."""
    monkeypatch.setenv("LOCAL_ATTN_BANDED_IMPL", "torch")
    attn = pande_layer(PANDE_LAYERS[layer])
    tgt = PANDE_BAND_MIN_KEYS
    assert path_of(attn, tgt) is Path.BY_HEAD_KIND
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tgt, 2, 16, dtype=torch.float64, generator=generator)
    directions = torch.randn(4, tgt, 2, 16, dtype=torch.float64, generator=generator)
    readout = torch.randn(x.numel(), 3, dtype=torch.float64, generator=generator)
    key_padding_mask = make_padding("left", 2, tgt)

    def layer_output(step):
        moved = x + torch.tensordot(step, directions, dims=1)
        out = attn(moved, moved, moved, key_padding_mask=key_padding_mask, need_weights=False)
        return out[0].flatten() @ readout

    step = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(layer_output, (step,))


def pande_layer_in_float64(attn, x, params):
    """A layer of Pande's heads (no padding) as the paper writes it, in float64: each head's
    softmax over every key, times its fixed mask (1 on the offsets j - i it keeps), times v; a
    tied head uses its owner's Q/K. ``params``: the layer's parameters by name."""
    tgt, bsz, dim = x.shape
    head_dim = dim // attn.num_heads

    def heads(name):
        y = x @ params[f"{name}.weight"].t() + params[f"{name}.bias"]
        return y.view(tgt, bsz, -1, head_dim).permute(1, 2, 0, 3)

    q, k, v = heads("q_proj"), heads("k_proj"), heads("v_proj")
    owners = sorted({(spec.qk_owner or (0, h))[1] for h, spec in enumerate(attn.head_specs)})
    offset = torch.arange(tgt)[None, :] - torch.arange(tgt)[:, None]  # j - i
    outputs = []
    for h, spec in enumerate(attn.head_specs):
        row = owners.index((spec.qk_owner or (0, h))[1])
        probs = (q[:, row] @ k[:, row].transpose(-1, -2) / head_dim**0.5).softmax(-1)
        lo, hi = spec.bounds.lo, spec.bounds.hi
        kept = torch.ones_like(offset, dtype=torch.bool)
        if lo is not None:
            kept &= offset >= lo
        if hi is not None:
            kept &= offset <= hi
        outputs.append((probs * kept) @ v[:, h])
    out = torch.stack(outputs, dim=1).permute(2, 0, 1, 3).reshape(tgt, bsz, dim)
    return out @ params["out_proj.weight"].t() + params["out_proj.bias"]


@pytest.mark.parametrize("layer", sorted(PANDE_LAYERS))
def test_a_short_layer_of_pande_band_heads_second_derivatives_are_right(monkeypatch, layer):
    """Below the band path's length the layer takes the explicit path (on PyTorch's operations,
    the route the C++ terms operator's refusal names), whose softmax is float32 (as fairseq's):
    its gradient penalty's gradients against the layer written out in float64."""
    monkeypatch.setenv("LOCAL_ATTN_MECHANISM_IMPL", "torch")  # not the C++ terms operator
    attn = pande_layer(PANDE_LAYERS[layer]).float()
    x = torch.randn(9, 2, 16, requires_grad=True)
    assert path_of(attn, 9) is Path.EXPLICIT

    def layer_output(x, params):
        return attn(x, x, x, need_weights=False)[0]

    second = gradient_penalty_gradients(layer_output, x, list(attn.parameters()))
    assert_second_derivatives_as_written_out(
        second, attn, x, functools.partial(pande_layer_in_float64, attn)
    )
