"""Checks shared by the attention module tests."""

import torch


def decode_step_by_step(attn, x, encoder_out=None, key_padding_mask=None, need_weights=True):
    """Outputs of feeding ``x`` one position at a time with fairseq's incremental state: causal
    self-attention, or (with ``encoder_out``) cross-attention over static encoder keys.
    ``need_weights=False`` calls the layer as fairseq's decoder calls its self-attention."""
    state = {}
    steps = []
    for t in range(x.size(0)):
        query = x[t : t + 1]
        if encoder_out is None:
            out = attn(query, query, query, incremental_state=state, need_weights=need_weights)[0]
        else:
            out = attn(query, encoder_out, encoder_out, key_padding_mask=key_padding_mask,
                       incremental_state=state, static_kv=True,
                       need_weights=need_weights)[0]  # fmt: skip
        steps.append(out)
    return torch.cat(steps)
