"""Nguyen et al.'s dynamic windows inside LocalMultiheadAttention: MW, AW, token and segment."""

import pytest
import torch

from local_attn_fairseq.locality.dynamic_window import soft_window_mask
from local_attn_fairseq.locality.spec import HeadSpec
from local_attn_fairseq.modules.local_multihead_attention import LocalMultiheadAttention

from .helpers import decode_step_by_step

E, H, D = 16, 4, 4
FUTURE = lambda n: torch.triu(torch.full((n, n), float("-inf")), 1)  # noqa: E731


def attention(heads, causal=False, seed=0, **kw):
    torch.manual_seed(seed)
    attn = LocalMultiheadAttention(E, H, head_specs=heads, causal=causal, **kw)
    attn.bind_qk_owners([attn])
    return attn.eval()


def window_heads(mw="mw", aw="aw"):
    return [HeadSpec(window=mw.split("-seg")[0], segment=_seg(mw)), HeadSpec(),
            HeadSpec(window=aw.split("-seg")[0], segment=_seg(aw)), HeadSpec("band-1")]  # fmt: skip


def _seg(token):
    return int(token.split("-seg")[1]) if "-seg" in token else None


def reference_weights(attn, x, pad):
    """Per-head weights written out from the paper's equations with the module's parameters."""
    bsz, n = x.size(1), x.size(0)
    rows = x.transpose(0, 1)

    def heads(proj):
        return proj(rows).view(bsz, n, -1, D).transpose(1, 2)

    q, k = heads(attn.q_proj) * D**-0.5, heads(attn.k_proj)
    masks = torch.cat([w(rows, rows, pad) for w in attn.dynamic_windows], dim=1)
    order = [h for g in attn.window_groups for h in g]
    M = {h: masks[:, i] for i, h in enumerate(order)}
    logits = q @ k.transpose(-1, -2)
    aw = attn.head_specs.index(next(s for s in attn.head_specs if s.window == "aw"))
    s_loc = (heads(attn.local_q_proj) * D**-0.5) @ heads(attn.local_k_proj).transpose(-1, -2)
    logits[:, aw] = logits[:, aw] + s_loc[:, 0] * M[aw]  # Eq. 16
    logits = logits.masked_fill(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    mw = attn.head_specs.index(next(s for s in attn.head_specs if s.window == "mw"))
    probs[:, mw] = probs[:, mw] * M[mw]  # Eq. 13
    band = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).abs() <= 1
    probs[:, 3] = probs[:, 3] * band
    return probs.transpose(0, 1)


@pytest.mark.parametrize("mw, aw", [("mw", "aw"), ("mw-seg2", "aw-seg3"), ("mw-seg5", "aw")])
def test_weights_follow_the_papers_equations(mw, aw):
    attn = attention(window_heads(mw, aw), self_attention=True)
    x = torch.randn(7, 2, E)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, :3] = True
    _, weights = attn(x, x, x, pad, need_head_weights=True)
    torch.testing.assert_close(weights, reference_weights(attn, x, pad), atol=1e-6, rtol=1e-5)
    assert len(attn.dynamic_windows) == (1 if _seg(mw) == _seg(aw) else 2)


def test_left_padding_changes_nothing_on_real_tokens():
    attn = attention(window_heads("mw-seg2", "aw"), self_attention=True)
    x = torch.randn(5, 1, E)
    padded = torch.cat([torch.randn(3, 1, E) * 50, x])
    pad = torch.zeros(1, 8, dtype=torch.bool)
    pad[0, :3] = True
    out, _ = attn(x, x, x)
    out_padded, _ = attn(padded, padded, padded, pad)
    torch.testing.assert_close(out_padded[3:], out, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("method", ["mw", "aw"])
def test_decoder_self_attention_incremental_equals_full(method):
    heads = [HeadSpec(window=method), HeadSpec(window=method), HeadSpec("prev-1"), HeadSpec()]
    attn = attention(heads, causal=True, self_attention=True)
    x = torch.randn(6, 2, E)
    full, _ = attn(x, x, x, attn_mask=FUTURE(6))
    torch.testing.assert_close(decode_step_by_step(attn, x), full, atol=1e-5, rtol=1e-4)
    plain = attention([HeadSpec(), HeadSpec(), HeadSpec("prev-1"), HeadSpec()], causal=True)
    plain.load_state_dict(attn.state_dict(), strict=False)
    assert not torch.allclose(plain(x, x, x, attn_mask=FUTURE(6))[0], full, atol=1e-3)


@pytest.mark.parametrize(
    "heads", [window_heads("mw-seg5", "aw-seg5"), window_heads("mw", "aw-seg2")]
)
def test_cross_attention_incremental_equals_full(heads):
    heads = [h.replace(mask="global") for h in heads]
    attn = attention(heads, kdim=E, vdim=E, encoder_decoder_attention=True)
    x, enc = torch.randn(5, 2, E), torch.randn(9, 2, E)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[0, :4] = True
    full, _ = attn(x, enc, enc, key_padding_mask=pad, static_kv=True)
    torch.testing.assert_close(decode_step_by_step(attn, x, enc, pad), full, atol=1e-5, rtol=1e-4)


def test_all_padding_sentence_gives_zeros_and_finite_gradients():
    attn = attention(window_heads("mw-seg2", "aw"), self_attention=True).train()
    x = torch.randn(4, 2, E, requires_grad=True)
    pad = torch.zeros(2, 4, dtype=torch.bool)
    pad[1] = True
    out, _ = attn(x, x, x, pad)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    for name, p in attn.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    window = attn.dynamic_windows[0]
    for proj in (window.query_pointers, window.key_pointers):
        assert all(half.abs().sum() > 0 for half in proj.weight.grad.chunk(2))  # W_L and W_R
    assert attn.local_q_proj.weight.grad.abs().sum() > 0


def test_window_mask_values_are_the_expected_discrete_mask():
    # The module's masks come from soft_window_mask (tested against brute force in
    # tests/locality); here: MW weights are the softmax times exactly that mask.
    attn = attention(window_heads(), self_attention=True)
    x = torch.randn(5, 1, E)
    rows = x.transpose(0, 1)
    phi_l, phi_r = attn.dynamic_windows[0].pointers(rows, rows)
    assert torch.allclose(attn.dynamic_windows[0](rows, rows), soft_window_mask(phi_l, phi_r))
