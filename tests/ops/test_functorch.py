"""torch.func's first derivatives (grad, vjp) through the operator's PyTorch routes, equal to
autograd's; and, where a transform would enter a compiled operator, one line that names the
operator and the route that works."""

import pytest
import torch

from local_attn_fairseq.locality.spec import HeadSpec
from local_attn_fairseq.modules.local_multihead_attention import LocalMultiheadAttention
from local_attn_fairseq.ops import band_with_global_lse, extension_info, mechanisms
from local_attn_fairseq.ops.banded_attention import banded_attention

from .test_band_with_global_lse import BANDS, inputs, left_padding
from .test_banded_attention import make_padding, make_qkv

BANDED_IMPL, MECHANISM_IMPL = "LOCAL_ATTN_BANDED_IMPL", mechanisms.IMPL_ENV
needs_extension = pytest.mark.skipif(not extension_info()["loaded"], reason="extension not built")


def assert_torch_func_matches_autograd(function, args, seed=0):
    """torch.func.grad of a scalar of ``function(*args)`` and torch.func.vjp of a random
    cotangent, against torch.autograd.grad of the same, for every tensor of ``args``."""
    leaves = [a.detach().requires_grad_() for a in args]
    plain = [a.detach() for a in args]
    output = function(*leaves)
    cotangent = torch.randn(output.shape, dtype=output.dtype,
                            generator=torch.Generator().manual_seed(seed))  # fmt: skip

    def loss(*tensors):
        return (function(*tensors) * cotangent).sin().sum()

    expected = torch.autograd.grad(loss(*leaves), leaves)
    got = torch.func.grad(loss, argnums=tuple(range(len(args))))(*plain)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    assert any(e.abs().max() > 1e-3 for e in expected)  # gradients that can differ
    out, vjp = torch.func.vjp(function, *plain)
    torch.testing.assert_close(out, output.detach())
    expected = torch.autograd.grad(output, leaves, cotangent)
    for g, e in zip(vjp(cotangent), expected):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("pad", ["none", "left", "empty_row"])
def test_banded_attention_on_the_torch_route(monkeypatch, pad):
    monkeypatch.setenv(BANDED_IMPL, "torch")
    q, k, v = make_qkv(2, 3, 9, 4)
    key_padding_mask = make_padding(pad, 2, 9)

    def attention(q, k, v):
        return banded_attention(q, k, v, [2, 0, 1], [1, 3, 0], key_padding_mask)

    assert_torch_func_matches_autograd(attention, (q, k, v))


IMPLS = ["torch", "extension"] if extension_info()["loaded"] else ["torch"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
def test_band_of_full_softmax(monkeypatch, impl, causal):
    """Pande's band heads: the forward may run on the compiled kernels (below the transform);
    torch.func differentiates with create_graph, where the backward is PyTorch's composition."""
    monkeypatch.setenv(BANDED_IMPL, impl)
    q, k, v = inputs(torch.float64, length=9)
    padding = left_padding(3, 9)

    def band(q, k, v):
        return band_with_global_lse.band_of_full_softmax(q, k, v, BANDS, padding, causal=causal)

    assert_torch_func_matches_autograd(band, (q, k, v))


@pytest.mark.parametrize("causal, block_rows", [(False, None), (True, None), (True, 2)])
def test_all_keys_logsumexp(causal, block_rows):
    """On PyTorch's CPU flash attention and per block of queries; rows without keys (-inf)
    left out of the loss, whose sine would be NaN."""
    q, k, _ = inputs(torch.float64, heads=2, length=9)
    padding = left_padding(3, 9)

    def finite_lse(q, k):
        lse = band_with_global_lse.all_keys_logsumexp(q, k, 0.4, padding, causal, block_rows)
        return torch.where(torch.isfinite(lse), lse, 0.0)

    assert_torch_func_matches_autograd(finite_lse, (q, k))


LAYERS = {
    "gaussian": [HeadSpec(gaussian=True)] * 4,
    "mw": [HeadSpec(window="mw")] * 4,
    "aw-seg2 and gaussian": [HeadSpec(window="aw", segment=2, gaussian=True)] * 4,
    "local": [HeadSpec("local-1"), HeadSpec("local-2")] * 2,
    "local and global": [HeadSpec("local-1"), HeadSpec("band-2"), HeadSpec(), HeadSpec()],
}


def layer_and_call(layout):
    torch.manual_seed(0)
    attn = LocalMultiheadAttention(16, 4, head_specs=LAYERS[layout], self_attention=True)
    attn.bind_qk_owners([attn])
    padding = make_padding("left", 3, 6)
    names = [name for name, _ in attn.named_parameters()]

    def call(x, *params):
        parameters = dict(zip(names, params))
        out = torch.func.functional_call(attn, parameters, (x, x, x),
                                         dict(key_padding_mask=padding, need_weights=False))
        return out[0]  # fmt: skip

    x = torch.randn(6, 3, 16, dtype=torch.float64)
    return call, (x, *(p.detach().double() for p in attn.parameters()))


@pytest.mark.parametrize("layout", sorted(LAYERS))
def test_layer_on_the_torch_routes(monkeypatch, layout):
    monkeypatch.setenv(BANDED_IMPL, "torch")
    monkeypatch.setenv(MECHANISM_IMPL, "torch")
    call, args = layer_and_call(layout)
    assert_torch_func_matches_autograd(call, args)


# -- the compiled operators refuse, in one line naming the route -------------------------------


def refusal(name, route):
    return rf"^local_attn::{name}: torch\.func transforms cannot enter the compiled kernels; " \
           rf"set {route} \(PyTorch's operations, where torch\.func\.grad and torch\.func\.vjp " \
           rf"work\)$"  # fmt: skip


def compiled_operator_cases():
    from .test_operator_contract import all_samples

    samples = all_samples()
    routes = {"banded_forward": f"{BANDED_IMPL}=torch"}
    routes.update({name: f"{MECHANISM_IMPL}=torch" for name in
                   ("gaussian_localness", "dynamic_window_mask", "additive_window_term",
                    "dense_attention", "gaussian_attention", "window_attention",
                    "project_heads")})  # fmt: skip
    return {name: (samples[name][0], route) for name, route in routes.items()}


@needs_extension
@pytest.mark.parametrize("transform", ["grad", "vjp"])
@pytest.mark.parametrize("name", sorted(compiled_operator_cases()))
def test_compiled_operators_refuse_torch_func(name, transform):
    args, route = compiled_operator_cases()[name]
    op = getattr(torch.ops.local_attn, name)

    def first_output(first):
        outputs = op(first, *args[1:])
        return outputs if isinstance(outputs, torch.Tensor) else outputs[0]

    first = args[0].detach()
    with pytest.raises(RuntimeError, match=refusal(name, route)) as raised:
        if transform == "grad":
            torch.func.grad(lambda x: first_output(x).sum())(first)
        else:
            torch.func.vjp(first_output, first)
    assert len(str(raised.value).splitlines()) == 1


@needs_extension
@pytest.mark.parametrize(
    "layout, mechanism_impl, name, route",
    [("gaussian", "auto", "project_heads", f"{MECHANISM_IMPL}=torch"),
     ("local", "torch", "banded_forward", f"{BANDED_IMPL}=torch")],
)  # fmt: skip
def test_layer_on_compiled_routes_refuses(monkeypatch, layout, mechanism_impl, name, route):
    """The automatic routes of a layer on the CPU take the compiled operators; the refusal
    names the first one the call reaches and the setting that avoids it."""
    monkeypatch.setenv(BANDED_IMPL, "auto")
    monkeypatch.setenv(MECHANISM_IMPL, mechanism_impl)
    call, args = layer_and_call(layout)
    x, *params = (a.float() for a in args)
    with pytest.raises(RuntimeError, match=refusal(name, route)):
        torch.func.grad(lambda x: call(x, *params).sum())(x)
