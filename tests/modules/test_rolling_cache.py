"""The rolling window cache: a decoder self-attention layer whose every head is causal-local keeps
only the keys its windows still reach while decoding, with the full cache's outputs and those of
the full pass over the whole sequence (no step, no cache)."""

import pytest
import torch

from local_attn_fairseq.locality.spec import HeadSpec
from local_attn_fairseq.modules.local_multihead_attention import LocalMultiheadAttention
from local_attn_fairseq.modules.rolling_cache import FULL_CACHE_VARIABLE

E, H = 16, 4
LOCAL = ["local-2", "local-3-0", "local-1", "local-5"]  # reaches 5 keys back
FUTURE = lambda n: torch.triu(torch.full((n, n), float("-inf")), 1)  # noqa: E731


def decoder_attention(specs, **kw):
    torch.manual_seed(0)
    heads = [spec if isinstance(spec, HeadSpec) else HeadSpec(spec) for spec in specs]
    attn = LocalMultiheadAttention(
        E, len(heads), head_specs=heads, self_attention=True, causal=True, **kw
    )
    attn.bind_qk_owners([attn])
    return attn.eval()


def decode(attn, x, padding=None, reorder_at=None, new_order=None):
    """Step-by-step outputs as fairseq's decoder asks for them (a step's padding only where its
    token is padding), and the number of keys cached after each step."""
    state, outputs, cached = {}, [], []
    for t in range(x.size(0)):
        step_padding = None if padding is None or not padding[:, t].any() else padding[:, t : t + 1]
        query = x[t : t + 1]
        with torch.no_grad():
            out, _ = attn(query, query, query, step_padding, state, need_weights=False)
        outputs.append(out)
        cached.append(attn._get_input_buffer(state)["prev_key"].size(2))
        if t == reorder_at:  # beam search reorders the cache between steps
            attn.reorder_incremental_state(state, new_order)
            x = x.index_select(1, new_order)
            padding = None if padding is None else padding.index_select(0, new_order)
    return torch.cat(outputs), cached


def test_a_causal_local_layer_caches_at_most_its_window():
    attn = decoder_attention(LOCAL)
    x = torch.randn(40, 2, E)
    steps, cached = decode(attn, x)
    assert max(cached) == 5 and cached[-1] == 5  # the widest window's 5 past keys (+ the query)
    with torch.no_grad():
        full, _ = attn(x, x, x, attn_mask=FUTURE(40), need_weights=False)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-4)


def test_rolling_cache_equals_the_full_cache_with_padding_and_reordering(monkeypatch):
    """Left-padded prompts (padding at the first steps of one row; a row whose window holds only
    padding gives zeros) and a beam reordering mid-way; both caches against the full pass over
    the whole sequence, which takes no step (after the reordering, over the rows it chose)."""
    attn = decoder_attention(LOCAL)
    x = torch.randn(30, 3, E)
    padding = torch.zeros(3, 30, dtype=torch.bool)
    padding[1, :12] = True
    padding[2, :3] = True
    order = dict(reorder_at=15, new_order=torch.tensor([2, 0, 0]))
    rolling, cached = decode(attn, x, padding, **order)
    assert cached[-1] == 5
    moved, moved_padding = x.index_select(1, order["new_order"]), padding[order["new_order"]]
    with torch.no_grad():
        before, _ = attn(x, x, x, padding, need_weights=False)
        after, _ = attn(moved, moved, moved, moved_padding, need_weights=False)
    torch.testing.assert_close(rolling[:16], before[:16], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(rolling[16:], after[16:], atol=1e-5, rtol=1e-4)
    monkeypatch.setenv(FULL_CACHE_VARIABLE, "1")
    full, cached = decode(attn, x, padding, **order)
    assert cached[-1] == 30
    torch.testing.assert_close(rolling, full, atol=1e-6, rtol=1e-5)
    # the padded row: zeros while its windows hold padding only, then windows over both
    assert rolling[:12, 1].abs().sum() == 0 and rolling[12:15, 1].abs().min() > 0


@pytest.mark.parametrize(
    "specs",
    [
        ["local-2", "local-2", "local-2", "global"],
        ["local-2", "local-2", "local-2", "band-2"],  # Pande: a band of the full softmax
        ["local-2", "local-2", "local-2", HeadSpec("local-2", gaussian=True)],
        ["local-2", "local-2", "local-2", HeadSpec("local-2", window="mw")],
    ],
    ids=["global", "pande-band", "gaussian", "dynamic-window"],
)
def test_a_layer_with_a_head_reaching_every_key_keeps_the_full_cache(specs):
    attn = decoder_attention(specs)
    assert attn.rolling_cache is None
    _, cached = decode(attn, torch.randn(12, 2, E))
    assert cached == list(range(1, 13))


def test_a_layer_whose_global_heads_are_pruned_rolls():
    attn = decoder_attention(["local-3", "global", "local-1-0", "global"], kept_heads=[0, 2])
    assert attn.rolling_cache is not None and attn.rolling_cache.reach == 3
    encoder_layer = LocalMultiheadAttention(E, H, head_specs=[HeadSpec("local-2")] * H,
                                            self_attention=True)  # fmt: skip
    assert encoder_layer.rolling_cache is None  # not causal: no incremental decoding


def test_a_window_of_the_query_alone_caches_nothing():
    """``local-0`` sees only the query: the cache keeps no past key, also over padding."""
    attn = decoder_attention(["local-0"] * H)
    x = torch.randn(6, 2, E)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[0, :2] = True
    steps, cached = decode(attn, x, padding)
    assert cached == [0] * 6
    with torch.no_grad():
        full, _ = attn(x, x, x, padding, attn_mask=FUTURE(6), need_weights=False)
    torch.testing.assert_close(steps[:, 1], full[:, 1], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(steps[2:, 0], full[2:, 0], atol=1e-5, rtol=1e-4)
