"""The windows that locality mechanisms learned: Gaussian localness (Yang et al. 2018, Figures
2-3) and dynamic windows (Nguyen et al. 2020).

Gaussian heads: the window D and centre P of every query, read back by
``localness.localness_windows``; the centre is reported as an offset from the query, P - i, and
as its distance |P - i|: a head that looks around its query keeps the distance near 0, while a
centre held in the middle of the sentence is about I/4 away on average and one pinned to its
first or last token about I/2.

Dynamic windows: every window head points at its left and right boundary with two softmaxes
phi_l, phi_r over the keys (``DynamicWindow.record`` keeps them). Per query i:

    E[l] = sum_j j phi_l(j),   E[r] = sum_j j phi_r(j),
    size = E|r - l| + 1 = sum_a sum_b phi_l(a) phi_r(b) |a - b| + 1,

the expected number of keys between the two pointers (crossed pointers span the same keys, as
in the mask of Eq. 9); for self-attention the boundaries are also given as offsets from the
query, E[l] - i and E[r] - i. Segment-based windows round the boundaries out to segments
after this; the pointers' own window is what is reported. A query without any visible key
(all-zero pointers) has no window.
"""

import contextlib
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..modules.local_multihead_attention import LocalMultiheadAttention
from .loading import AttentionKey, run_model
from .localness import gaussian_attention_modules, localness_windows


def dynamic_window_modules(model: nn.Module) -> Dict[AttentionKey, LocalMultiheadAttention]:
    found = {}
    for module in model.modules():
        if isinstance(module, LocalMultiheadAttention) and len(module.dynamic_windows):
            found[(module.attention_type, module.layer_index)] = module
    return found


def has_learned_windows(model: nn.Module) -> bool:
    return bool(gaussian_attention_modules(model) or dynamic_window_modules(model))


def query_positions(tgt_len: int, src_len: int) -> Tensor:
    """Key position of each query of a self-attention block (the last tgt_len keys)."""
    return torch.arange(src_len - tgt_len, src_len, dtype=torch.float32)


def gaussian_windows(model: nn.Module, sample: dict) -> Dict[AttentionKey, Dict[str, Tensor]]:
    """(attention type, layer) -> ``window`` D, ``offset`` P - i and ``distance`` |P - i|, each
    (heads, queries), for a one-sentence sample, and ``heads`` (the Gaussian heads' indices)."""
    result = {}
    for key, read in localness_windows(model, sample).items():
        window, centre = read["window"][0].float().cpu(), read["centre"][0].float().cpu()
        entry = {"window": window, "heads": read["heads"]}
        if key[0] != "decoder_cross":
            entry["offset"] = centre - torch.arange(centre.size(-1), dtype=torch.float32)
            entry["distance"] = entry["offset"].abs()
        result[key] = entry
    return result


@contextlib.contextmanager
def recording_pointers(modules):
    windows = [w for module in modules for w in module.dynamic_windows]
    for window in windows:
        window.record, window.last_pointers = True, None
    try:
        yield
    finally:
        for window in windows:
            window.record, window.last_pointers = False, None


def expected_window(phi_l: Tensor, phi_r: Tensor) -> Dict[str, Tensor]:
    """E[l], E[r] and E|r - l| + 1 of pointer distributions (..., queries, keys), for the
    queries whose pointers have some mass (the others are dropped: ``defined`` says which)."""
    phi_l, phi_r = phi_l.double(), phi_r.double()
    keys = phi_l.size(-1)
    position = torch.arange(keys, dtype=torch.float64)
    distance = (position[:, None] - position[None, :]).abs()
    defined = (phi_l.sum(-1) > 0) & (phi_r.sum(-1) > 0)
    spread = torch.einsum("...a,ab,...b->...", phi_l, distance, phi_r)
    return {
        "left": (phi_l * position).sum(-1).float(),
        "right": (phi_r * position).sum(-1).float(),
        "size": (spread + 1).float(),
        "defined": defined,
    }


@torch.no_grad()
def dynamic_windows(model: nn.Module, sample: dict) -> Dict[AttentionKey, Dict[str, Tensor]]:
    """(attention type, layer) -> ``size``, ``left``, ``right`` (and, for self-attention,
    ``left_offset``/``right_offset``), each (window heads, queries), ``defined`` (which
    queries have a window) and ``heads`` (the window heads' indices), for a one-sentence
    sample. Layers with several segment sizes list their groups' heads one after another."""
    modules = dynamic_window_modules(model)
    was_training = model.training
    model.eval()
    try:
        with recording_pointers(modules.values()):
            run_model(model, sample)
            recorded = {key: _read_pointers(module) for key, module in modules.items()}
    finally:
        model.train(was_training)
    return {key: value for key, value in recorded.items() if value is not None}


def _read_pointers(module: LocalMultiheadAttention) -> Optional[Dict[str, Tensor]]:
    phi_l, phi_r, heads = [], [], []
    for window, group in zip(module.dynamic_windows, module.window_groups):
        if window.last_pointers is None:
            return None  # the module did not run (no target for the decoder)
        left, right = window.last_pointers
        phi_l.append(left[0].cpu())
        phi_r.append(right[0].cpu())
        heads.extend(group)
    entry = expected_window(torch.cat(phi_l), torch.cat(phi_r))
    entry["heads"] = heads
    if module.attention_type != "decoder_cross":
        queries, keys = phi_l[0].shape[-2:]
        where = query_positions(queries, keys)
        entry["left_offset"] = entry["left"] - where
        entry["right_offset"] = entry["right"] - where
    return entry


class WindowStatistics:
    """Values per (mechanism, attention key, quantity), gathered over sentences, per head."""

    def __init__(self):
        self.values: Dict[Tuple[str, AttentionKey, str], List[List[float]]] = {}
        self.heads: Dict[Tuple[str, AttentionKey], List[int]] = {}

    def add(self, mechanism: str, key: AttentionKey, read: Dict[str, Tensor], quantities):
        self.heads[(mechanism, key)] = list(read["heads"])
        defined = read.get("defined")
        for quantity in quantities:
            if quantity not in read:
                continue
            values = read[quantity]
            per_head = self.values.setdefault(
                (mechanism, key, quantity), [[] for _ in read["heads"]]
            )
            for h, row in enumerate(values):
                kept = row if defined is None else row[defined[h]]
                per_head[h].extend(kept.tolist())
