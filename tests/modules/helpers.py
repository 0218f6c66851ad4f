"""Checks shared by the attention module tests."""

import torch


def decode_step_by_step(attn, x, encoder_out=None, key_padding_mask=None):
    """Outputs of feeding ``x`` one position at a time with fairseq's incremental state: causal
    self-attention, or (with ``encoder_out``) cross-attention over static encoder keys."""
    state = {}
    steps = []
    for t in range(x.size(0)):
        query = x[t : t + 1]
        if encoder_out is None:
            out = attn(query, query, query, incremental_state=state)[0]
        else:
            out = attn(query, encoder_out, encoder_out, key_padding_mask=key_padding_mask,
                       incremental_state=state, static_kv=True)[0]  # fmt: skip
        steps.append(out)
    return torch.cat(steps)
