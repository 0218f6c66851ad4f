"""Gaussian localness and relative positions inside LocalMultiheadAttention."""

import pytest
import torch

from local_attn_fairseq.locality.spec import HeadSpec
from local_attn_fairseq.modules.local_multihead_attention import LocalMultiheadAttention

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
