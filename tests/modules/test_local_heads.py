"""Local heads (``local-K``, ``local-L-R``): a softmax renormalised inside the window, computed by
the banded operator when a whole layer is local, without any T x T matrix."""

import pytest
import torch

from local_attn_fairseq.locality.fixed_masks import parse_mask
from local_attn_fairseq.locality.spec import HeadSpec
from local_attn_fairseq.modules.local_multihead_attention import LocalMultiheadAttention

from ..locality.test_dynamic_window import TensorRecorder

from .helpers import decode_step_by_step

E, H = 16, 4
FUTURE = lambda n: torch.triu(torch.full((n, n), float("-inf")), 1)  # noqa: E731


def attention(masks, causal=False, tied=False, **kw):
    torch.manual_seed(0)
    heads = [HeadSpec(m, (0, 0) if tied and h else None) for h, m in enumerate(masks)]
    attn = LocalMultiheadAttention(E, H, head_specs=heads, self_attention=True, causal=causal, **kw)
    attn.bind_qk_owners([attn])
    return attn.eval()


def test_local_mask_syntax():
    assert parse_mask("local-3") == (-3, 3, True)
    assert parse_mask("local-5-0") == (-5, 0, True)
    assert parse_mask("band-3") == (-3, 3, False)
    with pytest.raises(ValueError, match="negative window"):
        parse_mask("local-2--1")


def reference(attn, x, pad, masks):
    """Softmax over the window's real keys, written out with the module's projections."""
    T, B = x.shape[:2]
    q = attn.q_proj(x).view(T, B, H, 4).permute(1, 2, 0, 3) * 0.5
    k = attn.k_proj(x).view(T, B, H, 4).permute(1, 2, 0, 3)
    v = attn.v_proj(x).view(T, B, H, 4).permute(1, 2, 0, 3)
    logits = q @ k.transpose(-1, -2)
    offsets = torch.arange(T)[None, :] - torch.arange(T)[:, None]
    for h, m in enumerate(masks):
        lo, hi, _ = parse_mask(m)
        logits[:, h] = logits[:, h].masked_fill((offsets < lo) | (offsets > hi), float("-inf"))
    logits = logits.masked_fill(pad[:, None, None, :], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(logits, -1))  # rows without keys: zeros
    out = (probs @ v).permute(2, 0, 1, 3).reshape(T, B, E)
    return attn.out_proj(out)


@pytest.mark.parametrize("tied", [False, True])
def test_banded_and_explicit_paths_equal_the_written_out_softmax(tied):
    masks = ["local-1", "local-2-0", "local-0-3", "local-9"]
    attn = attention(masks, tied=tied)
    x = torch.randn(9, 3, E)
    pad = torch.zeros(3, 9, dtype=torch.bool)
    pad[1, :4] = True  # left padding
    pad[2] = True  # an all-padding sentence
    banded, _ = attn(x, x, x, pad, need_weights=False)
    explicit, weights = attn(x, x, x, pad, need_head_weights=True)
    expected = reference(attn, x, pad, masks) if not tied else explicit
    torch.testing.assert_close(banded, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(explicit, expected, atol=1e-5, rtol=1e-4)
    # every real query's window holds at least itself, and its weights sum to one
    sums = torch.cat([weights[:, 0].sum(-1), weights[:, 1, 4:].sum(-1)], dim=-1)
    torch.testing.assert_close(sums, torch.ones_like(sums))


def test_decoder_local_heads_decode_incrementally_like_the_full_pass():
    attn = attention(["local-2", "local-3-0", "local-1", "local-5"], causal=True)
    x = torch.randn(7, 2, E)
    banded, _ = attn(x, x, x, need_weights=False)  # the layer's own causality: the band path
    explicit, _ = attn(x, x, x, attn_mask=FUTURE(7), need_weights=False)  # a caller's mask
    stepped = decode_step_by_step(attn, x)
    torch.testing.assert_close(stepped, banded, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(stepped, explicit, atol=1e-5, rtol=1e-4)


def test_a_local_layer_builds_no_sequence_by_sequence_matrix():
    attn = attention(["local-4", "local-4", "local-8", "local-16"])
    length = 1024
    x = torch.randn(length, 1, E)
    recorder = TensorRecorder()
    with torch.no_grad(), recorder:
        out, _ = attn(x, x, x, need_weights=False)
    assert recorder.largest < length * length / 8  # a T x T matrix per head would be 4 T^2
    assert torch.isfinite(out).all()


def test_gradients_flow_through_the_banded_path():
    attn = attention(["local-2", "local-2", "local-3", "local-3"]).train()
    x = torch.randn(6, 2, E, requires_grad=True)
    attn(x, x, x, need_weights=False)[0].sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert attn.q_proj.weight.grad.abs().sum() > 0
