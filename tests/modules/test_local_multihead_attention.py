import pytest
import torch
from fairseq.modules import MultiheadAttention

from local_attn_fairseq.locality.fixed_masks import offset_mask, parse_mask
from local_attn_fairseq.locality.spec import HeadSpec
from local_attn_fairseq.modules.local_multihead_attention import LocalMultiheadAttention

from .helpers import decode_step_by_step

E, H = 16, 4
MASKS = ["band-1", "prev-1", "next-2", "global"]


def heads(masks, owners=None):
    owners = owners or [None] * len(masks)
    return [HeadSpec(m, o) for m, o in zip(masks, owners)]


def local_attention(masks=MASKS, owners=None, layer=0, **kw):
    torch.manual_seed(0)
    attn = LocalMultiheadAttention(
        E, H, self_attention=True, head_specs=heads(masks, owners), layer_index=layer, **kw
    )
    attn.bind_qk_owners([attn])
    return attn.eval()


def reference(attn, x, key_padding_mask=None, causal=False):
    """Per-head attention written out: full softmax over real keys, then the binary mask."""
    T, B, _ = x.shape
    d = E // H
    q = (x @ attn.q_proj.weight.T + attn.q_proj.bias).view(T, B, -1, d)
    k = (x @ attn.k_proj.weight.T + attn.k_proj.bias).view(T, B, -1, d)
    v = attn.v_proj(x).view(T, B, H, d)
    out = torch.zeros(T, B, H, d)
    for b in range(B):
        for h in range(H):
            g = attn.head_to_group[h]
            logits = q[:, b, g] @ k[:, b, g].T / d**0.5
            allowed = torch.ones(T, T, dtype=torch.bool)
            if key_padding_mask is not None:
                allowed &= ~key_padding_mask[b][None, :]
            if causal:
                allowed &= torch.ones(T, T).tril().bool()
            p = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
            p = p * offset_mask([attn.mask_bounds[h]], T, T)[0]
            out[:, b, h] = p @ v[:, b, h]
    return attn.out_proj(out.reshape(T, B, E))


def test_plain_heads_match_fairseq_multihead_attention():
    torch.manual_seed(0)
    ours = local_attention(["global"] * H)
    theirs = MultiheadAttention(E, H, self_attention=True).eval()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(7, 3, E)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, :2] = True
    future = torch.triu(torch.full((7, 7), float("-inf")), 1)
    for kw in ({}, {"key_padding_mask": pad}, {"attn_mask": future}):
        for need_weights in (False, True):  # fused and explicit paths
            a, wa = ours(x, x, x, need_weights=need_weights, **kw)
            b, wb = theirs(x, x, x, need_weights=need_weights, **kw)
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            if need_weights:
                torch.testing.assert_close(wa, wb, atol=1e-6, rtol=1e-5)


def test_masks_multiply_the_full_softmax():
    attn = local_attention()
    x = torch.randn(6, 2, E)
    out, w = attn(x, x, x, need_head_weights=True)
    torch.testing.assert_close(out, reference(attn, x), atol=1e-5, rtol=1e-5)
    # the weights keep the full-softmax values inside the mask and do not sum to one
    assert w.shape == (H, 2, 6, 6)
    assert (w[0].sum(-1) < 1).all() and (w[0].sum(-1) > 0).all()
    assert (w[1, :, 0] == 0).all()  # prev-1: the first token has no previous token
    torch.testing.assert_close(w[3].sum(-1), torch.ones(2, 6))  # the global head is untouched


def test_left_padding_does_not_change_real_tokens():
    attn = local_attention()
    torch.manual_seed(1)
    short = torch.randn(4, 1, E)
    long_ = torch.randn(6, 1, E)
    x = torch.cat([torch.cat([torch.zeros(2, 1, E), short]), long_], dim=1)  # left-pad row 0
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[0, :2] = True
    out, _ = attn(x, x, x, key_padding_mask=pad)
    alone, _ = attn(short, short, short)
    torch.testing.assert_close(out[2:, 0:1], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, reference(attn, x, pad), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("masks", [MASKS, ["global"] * H])
@pytest.mark.parametrize("need_weights", [False, True])
def test_all_padding_row_gives_zeros_not_nan(masks, need_weights):
    attn = local_attention(masks)
    x = torch.randn(5, 2, E)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1] = True
    out, w = attn(x, x, x, key_padding_mask=pad, need_weights=need_weights)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:, 1], attn.out_proj.bias.expand(5, E))
    if need_weights:
        assert (w[1] == 0).all()


def test_bf16_padding_is_finite():
    attn = local_attention().to(torch.bfloat16)
    x = torch.randn(5, 2, E, dtype=torch.bfloat16)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[0, :3] = True
    out, w = attn(x, x, x, key_padding_mask=pad, need_weights=True)
    assert torch.isfinite(out).all() and torch.isfinite(w).all()


def test_tied_heads_share_one_projection_and_one_softmax():
    attn = local_attention(["identity", "band-1", "prev-1", "global"], [None, (0, 0), (0, 0), None])
    assert attn.q_proj.weight.shape == (2 * E // H, E)  # heads 0 and 3 own Wq
    assert attn.num_qk_groups == 2
    x = torch.randn(5, 1, E)
    out, w = attn(x, x, x, need_head_weights=True)
    torch.testing.assert_close(out, reference(attn, x), atol=1e-5, rtol=1e-5)
    # heads 1 and 2 are masked views of head 0's softmax: where both masks allow, values agree
    both = (
        offset_mask([parse_mask("band-1")], 5, 5)[0] & offset_mask([parse_mask("prev-1")], 5, 5)[0]
    )
    assert both.any()
    torch.testing.assert_close(w[1, 0][both], w[2, 0][both])


def test_tying_across_layers_shares_parameters_and_gradients():
    torch.manual_seed(0)
    owner = LocalMultiheadAttention(
        E,
        H,
        self_attention=True,
        layer_index=0,
        head_specs=heads(["identity"] + ["band-1"] * 3, [None] + [(0, 0)] * 3),
    )
    borrower = LocalMultiheadAttention(
        E, H, self_attention=True, layer_index=1, head_specs=heads(["prev-1"] * H, [(0, 0)] * H)
    )
    layers = [owner, borrower]
    for m in layers:
        m.bind_qk_owners(layers)
    assert borrower.q_proj is None and borrower.k_proj is None
    assert not any("q_proj" in n or "k_proj" in n for n, _ in borrower.named_parameters())
    x = torch.randn(4, 2, E)
    borrower(x, x, x)[0].sum().backward()
    assert owner.q_proj.weight.grad is not None and owner.q_proj.weight.grad.abs().sum() > 0


def test_incremental_decoding_matches_full_forward():
    attn = local_attention(["band-2", "prev-1", "identity", "global"])
    x = torch.randn(6, 2, E)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    future = torch.triu(torch.full((6, 6), float("-inf")), 1)
    full, _ = attn(x, x, x, key_padding_mask=pad, attn_mask=future)
    torch.testing.assert_close(full, reference(attn, x, causal=True), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decode_step_by_step(attn, x), full, atol=1e-5, rtol=1e-5)


def test_reorder_incremental_state_follows_beams():
    attn = local_attention(["band-1", "prev-1", "identity", "global"])
    x = torch.randn(3, 2, E)
    state = {}
    for t in range(3):
        attn(x[t : t + 1], x[t : t + 1], x[t : t + 1], incremental_state=state)
    before = attn._get_input_buffer(state)["prev_value"].clone()
    attn.reorder_incremental_state(state, torch.tensor([1, 1]))
    after = attn._get_input_buffer(state)["prev_value"]
    torch.testing.assert_close(after[0], before[1])


def test_hand_checked_weights_with_left_padding():
    """Zero Wq/Wk make every real key equally likely (1/3 for 3 real tokens); the masks then
    keep exactly the hand-derived entries, counted from the first real token."""
    masks = ["prev-1", "next-1", "band-1", "identity"]
    attn = local_attention(masks)
    with torch.no_grad():
        for proj in (attn.q_proj, attn.k_proj):
            proj.weight.zero_()
            proj.bias.zero_()
    x = torch.randn(5, 1, E)
    pad = torch.tensor([[True, True, False, False, False]])  # 2 pads, then 3 real tokens
    _, w = attn(x, x, x, key_padding_mask=pad, need_head_weights=True)
    third = 1 / 3
    expected = {  # rows: real tokens 0..2; columns: real keys 0..2
        "prev-1": [[0, 0, 0], [third, 0, 0], [0, third, 0]],
        "next-1": [[0, third, 0], [0, 0, third], [0, 0, 0]],
        "band-1": [[third, third, 0], [third, third, third], [0, third, third]],
        "identity": [[third, 0, 0], [0, third, 0], [0, 0, third]],
    }
    for h, name in enumerate(masks):
        torch.testing.assert_close(w[h, 0, 2:, 2:], torch.tensor(expected[name]))
        assert (w[h, 0, :, :2] == 0).all()  # padding keys get nothing
