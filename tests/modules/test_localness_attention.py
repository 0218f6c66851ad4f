"""Gaussian localness and relative positions inside LocalMultiheadAttention."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from local_attn_fairseq.locality.spec import HeadSpec
from local_attn_fairseq.modules.local_multihead_attention import LocalMultiheadAttention
from local_attn_fairseq.ops import mechanisms

from .helpers import decode_step_by_step

E, H = 16, 4
FUTURE = lambda n: torch.triu(torch.full((n, n), float("-inf")), 1)  # noqa: E731


def attention(
    strategy="query", rel=None, values=False, causal=False, heads=None, centre="paper", **kw
):
    torch.manual_seed(0)
    heads = heads or [
        HeadSpec("global", None, True),
        HeadSpec("band-1", None, True),
        HeadSpec("global"),
        HeadSpec("prev-1", (0, 0), True),
    ]
    attn = LocalMultiheadAttention(
        E,
        H,
        head_specs=heads,
        causal=causal,
        localness={"window": strategy, "centre": centre},
        relative_max_distance=rel,
        relative_values=values,
        **kw,
    )
    attn.bind_qk_owners([attn])
    return attn.eval()


@pytest.mark.parametrize("centre", ["paper", "code"])
@pytest.mark.parametrize("strategy", ["fixed", "layer", "query", "head"])
def test_decoder_self_attention_incremental_equals_full(strategy, centre):
    attn = attention(strategy, rel=2, values=True, causal=True, self_attention=True, centre=centre)
    assert attn.localness.centre == centre
    x = torch.randn(6, 2, E)
    full, _ = attn(x, x, x, attn_mask=FUTURE(6))
    torch.testing.assert_close(decode_step_by_step(attn, x), full, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("centre", ["paper", "code"])
@pytest.mark.parametrize("strategy", ["layer", "query"])
def test_cross_attention_incremental_equals_full(strategy, centre):
    heads = [HeadSpec("global", None, True)] * 2 + [HeadSpec("global")] * 2
    attn = attention(
        strategy, heads=heads, kdim=E, vdim=E, encoder_decoder_attention=True, centre=centre
    )
    x, enc = torch.randn(5, 2, E), torch.randn(7, 2, E)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[0, :3] = True  # left-padded source
    full, _ = attn(x, enc, enc, key_padding_mask=pad, static_kv=True)
    torch.testing.assert_close(decode_step_by_step(attn, x, enc, pad), full, atol=1e-5, rtol=1e-4)


def test_encoder_left_padding_matches_the_sentence_alone():
    attn = attention("layer", rel=3, values=True, self_attention=True)
    x = torch.randn(4, 1, E)
    padded = torch.cat([torch.zeros(3, 1, E), x])
    pad = torch.tensor([[True] * 3 + [False] * 4])
    out, _ = attn(padded, padded, padded, key_padding_mask=pad)
    alone, _ = attn(x, x, x)
    torch.testing.assert_close(out[3:], alone, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_length_one_and_all_padding_rows_are_finite(dtype):
    attn = attention("query", rel=2, values=True, self_attention=True).to(dtype)
    x = torch.randn(3, 3, E, dtype=dtype)
    pad = torch.zeros(3, 3, dtype=torch.bool)
    pad[1, :2] = True  # length 1
    pad[2] = True  # nothing real
    out, w = attn(x, x, x, key_padding_mask=pad, need_head_weights=True)
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    assert (w[:, 2] == 0).all()
    one, _ = attn(x[2:, 1:2], x[2:, 1:2], x[2:, 1:2])
    assert torch.isfinite(one).all()


def test_gaussian_head_prefers_its_centre():
    attn = attention("fixed", heads=[HeadSpec("global", None, True)] + [HeadSpec("global")] * 3)
    with torch.no_grad():
        for p in (attn.q_proj, attn.k_proj):
            p.weight.zero_()
            p.bias.zero_()
    x = torch.randn(9, 1, E)
    _, w = attn(x, x, x, need_head_weights=True)
    # equal logits: the Gaussian alone decides, peaking at P = I sigmoid(0) = 4.5
    assert w[0, 0].argmax(-1).tolist() in ([4] * 9, [5] * 9)
    torch.testing.assert_close(w[1, 0], torch.full((9, 9), 1 / 9))


def test_gaussian_head_under_the_code_convention_centres_on_the_middle_token():
    """Yang et al.'s code: P = (I - 1) sigmoid(0) = 4, exactly the middle of 9 tokens."""
    heads = [HeadSpec("global", None, True)] + [HeadSpec("global")] * 3
    attn = attention("fixed", heads=heads, centre="code")
    with torch.no_grad():
        for p in (attn.q_proj, attn.k_proj):
            p.weight.zero_()
            p.bias.zero_()
    x = torch.randn(9, 1, E)
    _, w = attn(x, x, x, need_head_weights=True)
    assert w[0, 0].argmax(-1).tolist() == [4] * 9
    torch.testing.assert_close(w[0, 0, :, :4], w[0, 0, :, 5:].flip(-1))  # symmetric about it


def test_tied_gaussian_heads_match_a_written_out_reference():
    """Heads sharing Wq/Wk share logits, but each Gaussian head adds its own bias."""
    heads = [HeadSpec("global", None, True), HeadSpec("band-1", None, True),
             HeadSpec("global"), HeadSpec("prev-1", (0, 0), True)]  # fmt: skip
    attn = attention("query", heads=heads, self_attention=True)
    x = torch.randn(5, 2, E)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, :2] = True
    out, w = attn(x, x, x, key_padding_mask=pad, need_head_weights=True)

    d = E // H
    q = attn.q_proj(x).view(5, 2, 3, d).permute(1, 2, 0, 3)  # three Q/K groups
    k = attn.k_proj(x).view(5, 2, 3, d).permute(1, 2, 0, 3)
    v = attn.v_proj(x).view(5, 2, H, d).permute(1, 2, 0, 3)
    bias, _, _ = attn.localness(
        q.transpose(1, 2).flatten(2), k.transpose(1, 2).flatten(2), pad, False
    )
    group, gaussian_slot = [0, 1, 2, 0], {0: 0, 1: 1, 3: 2}
    expected_w = torch.zeros(H, 2, 5, 5)
    for h in range(H):
        logits = q[:, group[h]] @ k[:, group[h]].transpose(-1, -2) * d**-0.5
        if h in gaussian_slot:
            logits = logits + bias[:, gaussian_slot[h]]
        p = torch.softmax(logits.masked_fill(pad[:, None, :], float("-inf")), -1)
        bounds = attn.mask_bounds[h]
        offsets = torch.arange(5)[None, :] - torch.arange(5)[:, None]
        allowed = torch.ones(5, 5, dtype=torch.bool)
        if bounds.lo is not None:
            allowed &= (offsets >= bounds.lo) & (offsets <= bounds.hi)
        expected_w[h] = p * allowed
    torch.testing.assert_close(w, expected_w, atol=1e-5, rtol=1e-4)
    expected = torch.einsum("hbts,bhsd->bhtd", expected_w, v).permute(2, 0, 1, 3).reshape(5, 2, E)
    torch.testing.assert_close(out, attn.out_proj(expected), atol=1e-5, rtol=1e-4)


# -- LOCAL_ATTN_MECHANISM_IMPL=sdpa: the bias as scaled_dot_product_attention's mask ------------

def gaussian_layer(causal=False, dtype=torch.float32, dim=E, heads=H, dropout=0.0, **localness):
    """A self-attention layer whose every head has the Gaussian bias and nothing else."""
    torch.manual_seed(0)
    attn = LocalMultiheadAttention(
        dim,
        heads,
        head_specs=[HeadSpec("global", None, True)] * heads,
        causal=causal,
        self_attention=True,
        dropout=dropout,
        localness={"window": "query", **localness},
    )
    attn.bind_qk_owners([attn])
    return attn.to(dtype).train()


def count_sdpa_calls(monkeypatch):
    calls = []
    sdpa = F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(kwargs.get("dropout_p", 0.0))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    return calls


@pytest.mark.parametrize("causal", [False, True])
def test_gaussian_layer_through_sdpa_equals_the_explicit_route(monkeypatch, causal):
    """Outputs and gradients (input and every parameter) of the one-call route equal those of
    logits + bias, masks, softmax and product; left padding, and a sentence that is all
    padding, whose outputs are zeros. ``auto`` keeps the explicit route."""
    attn = gaussian_layer(causal)
    x = torch.randn(6, 3, E, requires_grad=True)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[0, :2] = True
    pad[2] = True
    future = FUTURE(6) if causal else None
    leaves = [x, *attn.parameters()]
    calls = count_sdpa_calls(monkeypatch)

    def outputs_and_gradients(impl):
        monkeypatch.setenv(mechanisms.IMPL_ENV, impl)
        for leaf in leaves:
            leaf.grad = None
        out = attn(x, x, x, key_padding_mask=pad, need_weights=False, attn_mask=future)[0]
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
        return out.detach(), [leaf.grad.clone() for leaf in leaves]

    out, grads = outputs_and_gradients("sdpa")
    assert len(calls) == 1
    ref, ref_grads = outputs_and_gradients("torch")
    outputs_and_gradients("auto")
    assert len(calls) == 1  # neither the explicit route nor auto called it
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for grad, want in zip(grads, ref_grads):
        torch.testing.assert_close(grad, want, atol=1e-5, rtol=1e-4)
    assert not out[:, 2].any() and all(torch.isfinite(g).all() for g in grads)


def test_gaussian_sdpa_route_keeps_a_narrow_window_in_float16(monkeypatch):
    """A window of 0.001 puts the bias below float16's range on every key of a row
    (-2 (j - P)^2 / D^2 < -65504 already at |j - P| = 0.5): the row is shifted by its largest
    value first, so the nearest key still wins, as in float32."""
    reference = gaussian_layer(window="fixed", fixed_window=0.001)
    half = gaussian_layer(dtype=torch.float16, window="fixed", fixed_window=0.001)
    half.load_state_dict(reference.state_dict())
    x = torch.randn(12, 2, E)
    pad = torch.zeros(2, 12, dtype=torch.bool)
    pad[0, :3] = True
    monkeypatch.setenv(mechanisms.IMPL_ENV, "torch")
    want = reference(x, x, x, key_padding_mask=pad, need_weights=False)[0]
    monkeypatch.setenv(mechanisms.IMPL_ENV, "sdpa")
    x16 = x.half().requires_grad_()
    out = half(x16, x16, x16, key_padding_mask=pad, need_weights=False)[0]
    out.float().sum().backward()
    torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=1e-2)
    assert torch.isfinite(x16.grad).all()


def test_gaussian_sdpa_route_applies_the_attention_dropout(monkeypatch):
    attn = gaussian_layer(dropout=0.25)
    monkeypatch.setenv(mechanisms.IMPL_ENV, "sdpa")
    calls = count_sdpa_calls(monkeypatch)
    x = torch.randn(5, 2, E)
    attn.train()(x, x, x, need_weights=False)
    attn.eval()(x, x, x, need_weights=False)
    assert calls == [0.25, 0.0]


def test_gaussian_sdpa_route_decodes_step_by_step_as_the_full_pass(monkeypatch):
    monkeypatch.setenv(mechanisms.IMPL_ENV, "sdpa")
    attn = gaussian_layer(causal=True).eval()
    calls = count_sdpa_calls(monkeypatch)
    x = torch.randn(6, 2, E)
    full, _ = attn(x, x, x, attn_mask=FUTURE(6), need_weights=False)
    steps = decode_step_by_step(attn, x, need_weights=False)
    assert len(calls) == 7  # the full pass and each of the six steps
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-4)


def relative_error(found: torch.Tensor, want: torch.Tensor) -> float:
    return ((found.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["any", "efficient"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gaussian_sdpa_route_on_cuda_matches_the_explicit_route(monkeypatch, dtype, backend):
    """On a GPU in half precision, as fairseq-train --fp16 / --bf16 runs it: outputs and
    gradients of the one-call route against the explicit route's. ``efficient`` pins PyTorch's
    memory-efficient kernel, which fuses a mask that needs a gradient."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    attn = gaussian_layer(dtype=dtype, dim=64, heads=4).cuda()
    x = torch.randn(40, 8, 64, device="cuda", dtype=dtype, requires_grad=True)
    pad = torch.zeros(8, 40, dtype=torch.bool, device="cuda")
    pad[::2, :11] = True
    # k_proj's bias moves every logit of a row alike, which softmax ignores: its gradient is 0
    # up to rounding on both routes, so it has no relative error to compare
    leaves = [x] + [p for name, p in attn.named_parameters() if name != "k_proj.bias"]
    results = {}
    for impl in ("sdpa", "torch"):
        monkeypatch.setenv(mechanisms.IMPL_ENV, impl)
        for leaf in leaves:
            leaf.grad = None
        pinned = sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]) if backend == "efficient" else None
        with pinned or contextlib.nullcontext():
            out = attn(x, x, x, key_padding_mask=pad, need_weights=False)[0]
            out.float().square().sum().backward()
        results[impl] = (out.detach(), [leaf.grad.clone() for leaf in leaves])
    (out, grads), (ref, ref_grads) = results["sdpa"], results["torch"]
    tolerance = 2e-2 if dtype == torch.float16 else 6e-2
    assert relative_error(out, ref) < tolerance
    for grad, want in zip(grads, ref_grads):
        assert torch.isfinite(grad).all() and relative_error(grad, want) < tolerance
