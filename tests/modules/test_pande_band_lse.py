"""Pande's band heads in LocalMultiheadAttention without a T x T matrix: the band of the full
softmax from the banded operator and the log-sum-exp over all keys, against the explicit path
(full softmax, then the 0/1 mask; ``banded_kernel=False``)."""

import importlib

import pytest
import torch

from local_attn_fairseq.locality.spec import HeadSpec
from local_attn_fairseq.modules.local_multihead_attention import LocalMultiheadAttention

from ..locality.test_dynamic_window import TensorRecorder
from ..models.helpers import assert_incremental_decoding_matches_full_forward, build_model
from ..conftest import TINY_MODEL
from .helpers import decode_step_by_step

attention_module = importlib.import_module("local_attn_fairseq.modules.local_multihead_attention")
plan_module = importlib.import_module("local_attn_fairseq.modules.attention_plan")
lse_module = importlib.import_module("local_attn_fairseq.ops.band_with_global_lse")

E, H = 32, 4
FUTURE = lambda n: torch.triu(torch.full((n, n), float("-inf")), 1)  # noqa: E731
# The explicit path forms its softmax in float32 whatever the input dtype; ours in float64.
TOLERANCE = {torch.float64: dict(atol=1e-6, rtol=1e-5), torch.float32: dict(atol=2e-5, rtol=2e-4)}

LAYOUTS = {
    "pande": ["band-2", "prev-1", "next-2", "identity"],
    "with-global": ["band-1", "prev-2", "global", "global"],
    "with-local-and-global": ["band-2", "local-1", "global", "next-1"],
    "tied": ["identity", "band-2@0", "prev-1@0", "next-1@0"],
}


def attention(masks, causal=False, dtype=torch.float32, dropout=0.0):
    torch.manual_seed(0)
    specs = []
    for mask in masks:
        name, _, owner = mask.partition("@")
        specs.append(HeadSpec(name, (0, int(owner)) if owner else None))
    attn = LocalMultiheadAttention(
        E, H, head_specs=specs, self_attention=True, causal=causal, dropout=dropout
    )
    attn.bind_qk_owners([attn])
    return attn.to(dtype).eval()


def left_padded(batch, length):
    padding = torch.zeros(batch, length, dtype=torch.bool)
    padding[1, :3] = True
    if batch > 2:
        padding[2] = True  # a sentence of padding only
    return padding


def outputs_and_gradients(attn, x, banded, **kw):
    attn.banded_kernel = banded
    attn.zero_grad()
    x = x.detach().clone().requires_grad_()
    out, _ = attn(x, x, x, need_weights=False, **kw)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=x.dtype))
    grads = {name: p.grad.clone() for name, p in attn.named_parameters()}
    return out.detach(), x.grad, grads


def assert_paths_agree(attn, x, dtype, **kw):
    new = outputs_and_gradients(attn, x, True, **kw)
    explicit = outputs_and_gradients(attn, x, False, **kw)
    torch.testing.assert_close(new[0], explicit[0], **TOLERANCE[dtype])
    torch.testing.assert_close(new[1], explicit[1], **TOLERANCE[dtype])
    for name in new[2]:
        torch.testing.assert_close(new[2][name], explicit[2][name], **TOLERANCE[dtype], msg=name)
    return new[0]


@pytest.fixture(autouse=True)
def band_path_at_every_length(monkeypatch):
    """These short sequences take the band path too (by default it starts at longer ones)."""
    monkeypatch.setattr(plan_module, "PANDE_BAND_MIN_KEYS", 0)
    monkeypatch.setattr(plan_module, "LOCAL_BESIDE_GLOBAL_MIN_KEYS", 0)


@pytest.fixture(params=["cpu-flash", "blocked"])
def lse_route(request, monkeypatch):
    """The log-sum-exp over all keys through PyTorch's CPU flash attention, or per block."""
    if request.param == "blocked":
        monkeypatch.setattr(lse_module, "_CPU_FLASH", None)
    return request.param


@pytest.fixture
def band_calls(monkeypatch):
    """Counts the layer's calls of the band-of-full-softmax function (the new path)."""
    calls = []
    original = attention_module.band_of_full_softmax

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(attention_module, "band_of_full_softmax", spy)
    return calls


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_encoder_layer_equals_the_explicit_path(layout, dtype, band_calls, lse_route):
    attn = attention(LAYOUTS[layout], dtype=dtype)
    x = torch.randn(9, 3, E, dtype=dtype)
    out = assert_paths_agree(attn, x, dtype, key_padding_mask=left_padded(3, 9))
    assert band_calls == [1]  # the first pass took the new path, the second the explicit one
    assert torch.isfinite(out).all()
    # the all-padding sentence: every head gives zeros, the output is out_proj's bias
    torch.testing.assert_close(out[:, 2], attn.out_proj.bias.detach().expand(9, E))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_causal_decoder_layer_equals_the_explicit_path(layout, dtype, band_calls, lse_route):
    attn = attention(LAYOUTS[layout], causal=True, dtype=dtype)
    x = torch.randn(8, 2, E, dtype=dtype)
    assert_paths_agree(attn, x, dtype)  # causality from the layer, on both paths
    # with left-padded targets (--left-pad-target): the first rows have no key at all
    assert_paths_agree(attn, x, dtype, key_padding_mask=left_padded(2, 8))
    assert band_calls


@pytest.mark.parametrize("length", [1, 3])
def test_sequences_shorter_than_the_bands(length):
    attn = attention(["band-8", "prev-8", "next-8", "identity"], dtype=torch.float64)
    x = torch.randn(length, 2, E, dtype=torch.float64)
    assert_paths_agree(attn, x, torch.float64)
    assert_paths_agree(attn, x, torch.float64, key_padding_mask=left_padded(2, length))


@pytest.mark.parametrize("layout", ["pande", "with-local-and-global", "tied"])
def test_incremental_decoding_equals_the_full_pass(layout, band_calls):
    attn = attention(LAYOUTS[layout], causal=True)
    x = torch.randn(7, 2, E)
    with torch.no_grad():
        full, _ = attn(x, x, x, need_weights=False)
        steps = decode_step_by_step(attn, x)
    assert band_calls  # the full pass took the new path
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-4)


def test_asking_for_the_weights_keeps_the_explicit_path(band_calls):
    attn = attention(LAYOUTS["pande"])
    x = torch.randn(5, 2, E)
    out, weights = attn(x, x, x, need_head_weights=True)
    assert not band_calls and weights.shape == (H, 2, 5, 5)
    torch.testing.assert_close(attn(x, x, x, need_weights=False)[0], out, atol=1e-5, rtol=1e-4)


def test_a_band_layer_builds_no_sequence_by_sequence_matrix(monkeypatch, lse_route):
    monkeypatch.setattr(lse_module, "LSE_BLOCK_ELEMENTS", 2**16)  # for the blocked route
    attn = attention(LAYOUTS["with-local-and-global"][:2] + ["band-8", "prev-3"])
    length = 1024
    x = torch.randn(length, 1, E, requires_grad=True)
    recorder = TensorRecorder()
    with recorder:
        out, _ = attn(x, x, x, need_weights=False)
        out.sum().backward()
    assert recorder.largest < length * length / 8  # the explicit path's (B, H, T, T) is 4 T^2
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("causal", [False, True])
def test_local_and_global_heads_take_their_own_paths(causal, monkeypatch):
    """A layer of local and global heads without band heads (a long-context LM's mixed layer):
    the local heads on the banded operator, the global ones on fused attention, no T x T
    logits, and the explicit path's outputs and gradients."""
    attn = attention(["local-2", "global", "local-5", "global"], causal=causal)
    x = torch.randn(9, 3, E)
    mask = {} if causal else {"key_padding_mask": left_padded(3, 9)}
    assert_paths_agree(attn, x, torch.float32, **mask)
    monkeypatch.setattr(plan_module, "LOCAL_BESIDE_GLOBAL_MIN_KEYS", 48)
    attn.banded_kernel = True
    length = 1024
    x = torch.randn(length, 1, E, requires_grad=True)
    recorder = TensorRecorder()
    with recorder:
        out, _ = attn(x, x, x, need_weights=False)
        out.sum().backward()
    assert recorder.largest < length * length / 8  # the explicit path's (B, H, T, T) is 4 T^2
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rows_without_keys_give_zeros_not_nan(dtype):
    attn = attention(LAYOUTS["with-local-and-global"], dtype=dtype).train()
    x = torch.randn(6, 3, E, dtype=dtype, requires_grad=True)
    out, _ = attn(x, x, x, key_padding_mask=left_padded(3, 6), need_weights=False)
    out.float().sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    torch.testing.assert_close(out[:, 2], attn.out_proj.bias.detach().expand(6, E))
    reference = attention(LAYOUTS["with-local-and-global"])
    expected, _ = reference(x.float(), x.float(), x.float(), key_padding_mask=left_padded(3, 6))
    torch.testing.assert_close(out.float(), expected, atol=5e-2, rtol=5e-2)


def test_dropout_applies_to_the_band_weights_in_training_only():
    attn = attention(LAYOUTS["pande"], dropout=0.5)
    x = torch.randn(12, 2, E)
    evaluation = attn(x, x, x, need_weights=False)[0]
    attn.banded_kernel = False
    torch.testing.assert_close(attn(x, x, x, need_weights=False)[0], evaluation)
    attn.banded_kernel = True
    attn.train()
    torch.manual_seed(3)
    first = attn(x, x, x, need_weights=False)[0]
    torch.manual_seed(3)
    again = attn(x, x, x, need_weights=False)[0]
    torch.manual_seed(4)
    other = attn(x, x, x, need_weights=False)[0]
    torch.testing.assert_close(first, again)  # the keep mask comes from torch's generator
    assert not torch.allclose(first, evaluation) and not torch.allclose(first, other)
    # on average, dropout keeps the expected output
    mean = torch.stack([attn(x, x, x, need_weights=False)[0] for _ in range(200)]).mean(0)
    torch.testing.assert_close(mean, evaluation, atol=0.05, rtol=0.0)


BAND_SPEC = (
    "{encoder_self: {0-2: [band-1, band-2, prev-1, next-1, identity, global, global, local-2]},"
    " decoder_self: {all: [band-1, prev-1, prev-2, identity, global, global, global, global]}}"
)


def test_model_with_band_heads_equals_the_explicit_path_and_decodes_incrementally(tiny_data):
    """Through fairseq's model API: a left-padded batch, loss and gradients, then step-by-step
    decoding (as fairseq-generate runs it) against the full pass."""
    model, task, _ = build_model(tiny_data / "bin", "transformer_local", *TINY_MODEL,
                                 "--locality-config", BAND_SPEC)  # fmt: skip
    attentions = [m for m in model.modules() if isinstance(m, LocalMultiheadAttention)]
    d = task.source_dictionary
    sentences = ["Das ist gut .", "Er hat das Buch heute nicht gelesen ."]
    lines = [d.encode_line(s, add_if_not_exist=False).long() for s in sentences]
    src = torch.full((2, len(lines[1])), d.pad())
    src[0, -len(lines[0]) :], src[1] = lines[0], lines[1]
    prev = torch.cat([torch.full((2, 1), d.eos()), src[:, :-1].flip(0)], dim=1)
    model.train()
    results = []
    for banded in (True, False):
        for attn in attentions:
            attn.banded_kernel = banded
        model.zero_grad()
        torch.manual_seed(0)
        with torch.random.fork_rng():
            for module in model.modules():  # no dropout: the two paths draw masks differently
                if hasattr(module, "p") and isinstance(module.p, float):
                    module.p = 0.0
            logits, _ = model(src, torch.tensor([4, len(lines[1])]), prev)
        logits.float().logsumexp(-1).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((logits.detach(), grads))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-4)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    for attn in attentions:
        attn.banded_kernel = True
    assert_incremental_decoding_matches_full_forward(model, task)


def test_short_sequences_take_the_dense_path_by_default(band_calls, monkeypatch):
    """Below PANDE_BAND_MIN_KEYS keys the dense masks are cheaper; both paths agree."""
    monkeypatch.setattr(plan_module, "PANDE_BAND_MIN_KEYS", 12)
    attn = attention(LAYOUTS["tied"])
    for length, band_path in ((11, False), (12, True)):
        x = torch.randn(length, 2, E)
        band_calls.clear()
        out = assert_paths_agree(attn, x, torch.float32)
        assert band_calls == ([1] if band_path else [])
        assert torch.isfinite(out).all()
