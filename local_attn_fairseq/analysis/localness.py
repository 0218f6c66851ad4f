"""Read back what Gaussian localness heads learned (Yang et al. 2018, Figures 2-3).

    windows = localness_windows(model, sample)
    windows[("encoder_self", 0)]["window"]   # (bsz, gaussian heads, tgt_len): D per token
    windows[("encoder_self", 0)]["centre"]   # P per token, in real-token positions

The model runs one forward pass in eval mode on the sample (a fairseq batch with
``net_input``; the encoder alone when it has no ``prev_output_tokens``); every attention module
with Gaussian heads records its centres and windows.
"""

from typing import Dict, Tuple

import torch

from ..modules.local_multihead_attention import LocalMultiheadAttention
from .loading import run_model


def gaussian_attention_modules(model):
    """(attention type, layer) -> module, for every attention module with Gaussian heads."""
    found = {}
    for module in model.modules():
        if isinstance(module, LocalMultiheadAttention) and module.localness is not None:
            found[(module.attention_type, module.layer_index)] = module
    return found


@torch.no_grad()
def localness_windows(model, sample) -> Dict[Tuple[str, int], Dict[str, torch.Tensor]]:
    modules = gaussian_attention_modules(model)
    was_training = model.training
    model.eval()
    for module in modules.values():
        module.record_localness, module.last_localness = True, None
    try:
        run_model(model, sample)
    finally:
        for module in modules.values():
            module.record_localness = False
        model.train(was_training)
    result = {}
    for key, module in modules.items():
        centre, window = module.last_localness
        result[key] = {"centre": centre, "window": window, "heads": list(module.gaussian_heads)}
        module.last_localness = None
    return result
