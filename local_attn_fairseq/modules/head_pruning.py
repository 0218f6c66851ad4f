"""Pruning heads for real: a gated checkpoint in, a smaller checkpoint out.

The heads whose test-time gate is closed (Voita et al. 2019, footnote 7) are removed from the
weights: their Wq/Wk rows (unless another kept head uses them through tying), Wv rows, W_O
columns and per-head localness parameters. The pruned model's locality spec records the kept
heads (``heads_kept``) and has no gates, so fairseq-generate rebuilds it from the checkpoint alone
and it translates exactly as the gated model does in deterministic mode (open gates are exactly 1).
"""

import copy
import json
import logging
from typing import Dict, List, Tuple

import torch
from fairseq import checkpoint_utils, tasks

from ..file_safety import atomic_output, refuse_same_file
from ..locality.spec import ATTENTION_TYPES
from .local_multihead_attention import LocalMultiheadAttention

logger = logging.getLogger(__name__)

# Per-head parameters of GaussianLocalness: rows follow the layer's Gaussian heads.
_PER_GAUSSIAN_HEAD_ROWS = ("u_p.weight", "u_d.weight", "z")


def attention_modules(model) -> Dict[str, LocalMultiheadAttention]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LocalMultiheadAttention)}


def heads_by_layer(model, after_gates: bool) -> Dict[str, List[List[int]]]:
    """{attention type: per layer, the heads (unpruned numbering) it has, or, ``after_gates``,
    those whose test-time gate is open}."""
    heads: Dict[str, Dict[int, List[int]]] = {}
    for module in attention_modules(model).values():
        kept = list(module.kept_heads)
        if after_gates and module.head_gates is not None:
            gates = module.head_gates.deterministic().tolist()
            kept = [h for h, g in zip(kept, gates) if g > 0]
        heads.setdefault(module.attention_type, {})[module.layer_index] = kept
    return {t: [layers[i] for i in sorted(layers)] for t, layers in heads.items()}


def _rows(tensor, owned: List[int], wanted: List[int], width: int, dim: int = 0):
    """Slices of ``width`` rows (or columns) of the heads ``wanted`` out of the heads ``owned``."""
    index = [owned.index(h) * width + i for h in wanted for i in range(width)]
    return tensor.index_select(dim, torch.tensor(index, dtype=torch.long))


def pruned_attention_state(old: LocalMultiheadAttention, new: LocalMultiheadAttention, prefix):
    """Every entry of the new module's state dict, cut out of the old module's parameters.

    Entries the new module lacks are dropped: the gates (open heads pass through unchanged),
    and the projections of a layer without heads.
    """
    d = old.head_dim
    old_state = old.state_dict()
    state = {}
    for name in new.state_dict():
        proj, _, kind = name.partition(".")
        tensor = old_state.get(name)
        if proj in ("q_proj", "k_proj"):
            tensor = _rows(tensor, old.owned_heads, new.owned_heads, d)
        elif proj == "v_proj":
            tensor = _rows(tensor, old.kept_heads, new.kept_heads, d)
        elif proj == "out_proj" and kind == "weight":
            tensor = _rows(tensor, old.kept_heads, new.kept_heads, d, dim=1)
        elif proj == "localness" and kind in _PER_GAUSSIAN_HEAD_ROWS:
            tensor = _rows(tensor, *_heads(old, new, lambda m: m.gaussian_heads), 1)
        elif proj in ("local_q_proj", "local_k_proj"):
            tensor = _rows(tensor, *_heads(old, new, lambda m: m.aw_heads.tolist()), d)
        elif proj == "dynamic_windows":
            group, _, param = kind.partition(".")
            segment = new.dynamic_windows[int(group)].segment_size
            old_group = [w.segment_size for w in old.dynamic_windows].index(segment)
            tensor = old_state[f"dynamic_windows.{old_group}.{param}"]
            heads = _heads(old, new, lambda m: _window_group(m, segment))
            # rows: the left pointers' heads, then the right pointers'
            tensor = torch.cat([_rows(half, *heads, d) for half in tensor.chunk(2)])
        state[f"{prefix}.{name}"] = tensor
    return state


def _heads(old, new, positions):
    """The heads (unpruned numbering) at ``positions(module)`` in the old and the new module."""
    return [old.kept_heads[h] for h in positions(old)], [new.kept_heads[h] for h in positions(new)]


def _window_group(module, segment):
    """Positions of the heads whose windows one DynamicWindow of this segment size computes."""
    sizes = [w.segment_size for w in module.dynamic_windows]
    return module.window_groups[sizes.index(segment)]


def pruned_config(model_cfg, kept: Dict[str, List[List[int]]]):
    """The model configuration with the kept heads recorded and the gates gone."""
    cfg = copy.deepcopy(model_cfg)
    spec = json.loads(cfg.locality_config) if cfg.locality_config else {}
    spec["heads_kept"] = {t: kept[t] for t in ATTENTION_TYPES if t in kept}
    spec.pop("head_gates", None)
    cfg.locality_config = json.dumps(spec, sort_keys=True)
    # Options that would otherwise be written into the spec again on rebuilding.
    cfg.head_gates = None
    cfg.heads_kept = None
    cfg.freeze_decoder = False
    return cfg


def prune_checkpoint(checkpoint_in: str, checkpoint_out: str) -> Tuple[dict, dict, Tuple[int, int]]:
    """Write the pruned checkpoint; returns {type: kept heads per layer} before and after, and
    the number of model parameters before and after. The output never replaces the input, and
    is written to a temporary file renamed into place, so an interrupted write leaves no
    truncated checkpoint."""
    refuse_same_file(checkpoint_in, checkpoint_out)
    state = checkpoint_utils.load_checkpoint_to_cpu(checkpoint_in)
    cfg = state["cfg"]
    task = tasks.setup_task(cfg.task)
    gated = task.build_model(cfg.model)
    gated.load_state_dict(state["model"], strict=True, model_cfg=cfg.model)
    gated.eval()
    if not any(m.head_gates is not None for m in attention_modules(gated).values()):
        raise ValueError(f"{checkpoint_in} has no head gates: nothing says which heads to prune")
    before = heads_by_layer(gated, after_gates=False)
    kept = heads_by_layer(gated, after_gates=True)

    new_cfg = pruned_config(cfg.model, kept)
    pruned = task.build_model(new_cfg)
    new_modules = attention_modules(pruned)
    new_state = {k: v for k, v in gated.state_dict().items()}
    for name, old in attention_modules(gated).items():
        for key in [k for k in new_state if k.startswith(name + ".")]:
            del new_state[key]
        new_state.update(pruned_attention_state(old, new_modules[name], name))
    pruned.load_state_dict(new_state, strict=True, model_cfg=new_cfg)

    state["model"] = pruned.state_dict()
    state["cfg"].model = new_cfg
    # The optimizer's state has the old shapes; continue training with --reset-optimizer.
    state["last_optimizer_state"] = None
    with atomic_output(checkpoint_out) as temporary:
        torch.save(state, temporary)
    sizes = tuple(sum(p.numel() for p in m.parameters()) for m in (gated, pruned))
    return before, kept, sizes


def heads_table(before: dict, after: dict) -> str:
    """Heads per layer before and after pruning, one line per attention type."""
    lines = []
    for attn_type in ATTENTION_TYPES:
        if attn_type not in after:
            continue
        was = sum(len(h) for h in before[attn_type])
        now = sum(len(h) for h in after[attn_type])
        per_layer = " ".join(str(len(h)) for h in after[attn_type])
        lines.append(f"{attn_type:14s} {was:4d} -> {now:4d} heads   per layer: {per_layer}")
    return "\n".join(lines)
