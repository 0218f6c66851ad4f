"""One rule of causality: a causal layer's queries never see a later key, on every path (fused,
banded, by head kind, the terms operator, explicit), with or without a cache, with one or many new
queries; a caller's own mask is honoured on top of it, never swapped for a kernel's causal flag.

The reference for every head kind is the explicit path over the whole sequence with the causal
mask built here from positions (``need_weights=True`` takes the explicit path)."""

import pytest
import torch

from local_attn_fairseq.locality.spec import HeadSpec
from local_attn_fairseq.modules import attention_plan
from local_attn_fairseq.modules.attention_plan import Path
from local_attn_fairseq.modules.local_multihead_attention import LocalMultiheadAttention

E = 32
FUTURE = lambda n: torch.triu(torch.full((n, n), float("-inf")), 1)  # noqa: E731

# Every kind of head a decoder self-attention layer can have, alone and mixed.
HEAD_KINDS = {
    "global": ["global"] * 4,
    "tied-global": [HeadSpec("global"), HeadSpec("global", qk_owner=(0, 0))] * 2,
    "local": ["local-2", "local-3-1", "local-1", "local-5"],
    "symmetric-local": ["local-3"] * 4,
    "local-beside-global": ["local-2", "global", "local-4-2", "global"],
    "pande-masks": ["band-2", "prev-1", "next-1", "identity"],
    "pande-beside-local-and-global": ["band-1", "local-2", "global", "next-2"],
    "gaussian": [HeadSpec("global", gaussian=True)] * 4,
    "gaussian-some": [HeadSpec("global", gaussian=True), "global", "local-2", "global"],
    "window-mw": [HeadSpec("global", window="mw")] * 4,
    "window-aw": [HeadSpec("global", window="aw")] * 4,
    "window-some": [HeadSpec("global", window="mw"), "global", HeadSpec("global", window="aw"),
                    "local-1"],
}


def causal_layer(kind, **kw):
    torch.manual_seed(0)
    specs = [s if isinstance(s, HeadSpec) else HeadSpec(s) for s in HEAD_KINDS[kind]]
    attn = LocalMultiheadAttention(
        E, len(specs), head_specs=specs, self_attention=True, causal=True,
        attention_type="decoder_self", **kw,
    )  # fmt: skip
    attn.bind_qk_owners([attn])
    return attn.eval()


def explicit_reference(attn, x, key_padding_mask=None):
    """The explicit path with the causal mask given by the caller: the definition."""
    with torch.no_grad():
        out, _ = attn(x, x, x, key_padding_mask, attn_mask=FUTURE(x.size(0)), need_weights=True)
    return out


def in_chunks(attn, x, sizes):
    """The prompt fed through the incremental state a chunk of several tokens at a time, as a
    chunked prompt or speculative decoding does (fairseq passes no mask then)."""
    state, outputs, start = {}, [], 0
    for size in sizes:
        chunk = x[start : start + size]
        with torch.no_grad():
            outputs.append(attn(chunk, chunk, chunk, incremental_state=state, need_weights=False)[0])
        start += size
    assert start == x.size(0)
    return torch.cat(outputs)


@pytest.mark.parametrize("kind", sorted(HEAD_KINDS))
@pytest.mark.parametrize("length", [12, 64])  # 64: past the band paths' threshold
def test_a_causal_layer_without_a_mask_is_causal_on_its_own_path(kind, length):
    attn = causal_layer(kind)
    x = torch.randn(length, 2, E)
    with torch.no_grad():
        out, _ = attn(x, x, x, need_weights=False)
    torch.testing.assert_close(out, explicit_reference(attn, x), atol=1e-5, rtol=1e-4)
    later = x.clone()
    later[length // 2 :] += torch.randn_like(later[length // 2 :])
    with torch.no_grad():
        changed, _ = attn(later, later, later, need_weights=False)
    torch.testing.assert_close(changed[: length // 2], out[: length // 2], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", sorted(HEAD_KINDS))
def test_a_prompt_in_chunks_through_the_cache_equals_the_whole_causal_pass(kind):
    attn = causal_layer(kind)
    x = torch.randn(20, 2, E)
    chunked = in_chunks(attn, x, [3, 4, 1, 5, 7])
    torch.testing.assert_close(chunked, explicit_reference(attn, x), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["local", "symmetric-local", "local-beside-global", "global"])
def test_chunks_with_left_padding_equal_the_whole_pass(kind):
    """Left-padded prompts (--left-pad-target), padding carried by the cache's padding mask."""
    attn = causal_layer(kind)
    x = torch.randn(16, 3, E)
    padding = torch.zeros(3, 16, dtype=torch.bool)
    padding[1, :5] = True
    padding[2, :9] = True
    state, outputs = {}, []
    for start, size in ((0, 6), (6, 2), (8, 8)):
        chunk = x[start : start + size]
        with torch.no_grad():
            out, _ = attn(chunk, chunk, chunk, padding[:, start : start + size], state,
                          need_weights=False)  # fmt: skip
        outputs.append(out)
    chunked = torch.cat(outputs)
    reference = explicit_reference(attn, x, padding)
    real = ~padding.t()[:, :, None]
    torch.testing.assert_close(chunked * real, reference * real, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["local-beside-global", "pande-beside-local-and-global"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_a_mixed_layer_causal_and_padded_at_once(kind, side):
    """Local, global (and Pande's) heads of one causal layer over padded sentences, each kind on
    its own path (the length is past the threshold), against the explicit path."""
    attn = causal_layer(kind)
    length = 64
    x = torch.randn(length, 3, E)
    padding = torch.zeros(3, length, dtype=torch.bool)
    for row, n in ((1, 7), (2, 30)):
        if side == "left":
            padding[row, :n] = True
        else:
            padding[row, length - n :] = True
    assert attn.plan.path(x[None, None, :, :1], x, length, None, False) is Path.BY_HEAD_KIND
    with torch.no_grad():
        out, _ = attn(x, x, x, padding, need_weights=False)
    reference = explicit_reference(attn, x, padding)
    real = ~padding.t()[:, :, None]
    torch.testing.assert_close(out * real, reference * real, atol=1e-5, rtol=1e-4)


def _prefix_lm_mask(length, prefix):
    """A caller's own mask: the prefix sees itself whole, the rest is causal; plus one key every
    query is barred from."""
    mask = FUTURE(length)
    mask[:prefix, :prefix] = 0.0
    mask[:, 1] = float("-inf")
    mask[1, 0] = 0.0  # key 1's own query keeps key 0
    return mask


@pytest.mark.parametrize("kind", ["global", "local", "local-beside-global", "pande-masks"])
def test_a_callers_mask_is_honoured_on_top_of_causality_never_replaced(kind):
    """A non-causal layer takes the caller's mask exactly; a causal layer takes it together with
    its causality (the prefix does not see ahead), on its fast path as on the explicit one."""
    length = 64
    x = torch.randn(length, 2, E)
    mask = _prefix_lm_mask(length, prefix=10)
    attn = causal_layer(kind)
    with torch.no_grad():
        fast, _ = attn(x, x, x, attn_mask=mask, need_weights=False)
        explicit, _ = attn(x, x, x, attn_mask=mask, need_weights=True)
        causal_only, _ = attn(x, x, x, need_weights=False)
    torch.testing.assert_close(fast, explicit, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(fast, causal_only, atol=1e-4)  # the barred key made a difference
    both = torch.minimum(mask, FUTURE(length))  # -inf wherever either forbids
    with torch.no_grad():
        combined, _ = attn(x, x, x, attn_mask=both, need_weights=True)
    torch.testing.assert_close(fast, combined, atol=1e-5, rtol=1e-4)


def test_a_non_causal_layer_takes_the_callers_mask_alone():
    torch.manual_seed(0)
    attn = LocalMultiheadAttention(E, 4, self_attention=True).eval()
    x = torch.randn(12, 2, E)
    mask = _prefix_lm_mask(12, prefix=5)
    with torch.no_grad():
        fast, _ = attn(x, x, x, attn_mask=mask, need_weights=False)
        explicit, _ = attn(x, x, x, attn_mask=mask, need_weights=True)
    torch.testing.assert_close(fast, explicit, atol=1e-5, rtol=1e-4)
    # the prefix sees ahead inside itself: its outputs depend on a later prefix token
    later = x.clone()
    later[4] += 1.0
    with torch.no_grad():
        changed, _ = attn(later, later, later, attn_mask=mask, need_weights=False)
    assert not torch.allclose(changed[0], fast[0], atol=1e-5)


def test_the_plan_sends_causal_calls_with_a_callers_mask_off_the_band_paths():
    attn = causal_layer("local")
    q = torch.zeros(2, 4, 64, E // 4)
    assert attn.plan.path(q, q, 64, None, False) is Path.BANDED
    assert attn.plan.path(q, q, 64, FUTURE(64), False) is Path.EXPLICIT
    assert attn.plan.path(q[:, :, :3], q, 64, None, False) is Path.EXPLICIT  # a chunk on a cache
    assert attn.plan.path(q, q, 64, None, True) is Path.EXPLICIT


def test_mixed_layers_take_the_by_kind_path_from_their_own_threshold(monkeypatch):
    mixed, pande = causal_layer("local-beside-global"), causal_layer("pande-masks")
    q = torch.zeros(2, 4, 20, E // 4)
    monkeypatch.setattr(attention_plan, "LOCAL_BESIDE_GLOBAL_MIN_KEYS", 16)
    monkeypatch.setattr(attention_plan, "PANDE_BAND_MIN_KEYS", 32)
    assert mixed.plan.path(q, q, 20, None, False) is Path.BY_HEAD_KIND
    assert pande.plan.path(q, q, 20, None, False) is not Path.BY_HEAD_KIND


def test_the_decoder_builds_no_causal_mask():
    """fairseq's decoder would build a (T, T) float mask for every forward; the plugin's decoder
    layers apply causality themselves."""
    from local_attn_fairseq.modules.transformer_layers import LocalTransformerDecoder

    assert LocalTransformerDecoder.buffered_future_mask(None, torch.zeros(4096, 1, 8)) is None
