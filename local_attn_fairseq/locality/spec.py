"""The locality spec: what every head of every attention layer does, validated against a model.

A spec is data (a YAML/JSON mapping, a preset name, or a file) of this shape::

    name: 1loc7tied-all6
    encoder_self:                 # also decoder_self, decoder_cross
      all:                        # layer selector: N, "A-B", "A,B,C" or "all"
        [identity, identity@0, prev-1@0, prev-2@0, next-1@0, next-2@0, band-1@0, band-2@0]

Each head is ``MASK``, ``MASK+gaussian`` or ``gaussian``, optionally followed by ``@OWNER``: the
mask is one of ``fixed_masks``; ``gaussian`` adds Yang et al.'s learned localness bias (settings
under ``localness``); the owner is the head whose Wq/Wk it uses instead of its own, ``H`` (head H
of the same layer) or ``L.H`` (head H of layer L of the same attention type). Layers a spec does
not name have global heads with their own Wq/Wk, i.e. the plain Transformer.

Layer-wide mechanisms sit beside the attention types::

    localness: {window: query, layers: {encoder_self: 0-2}}   # Yang et al. 2018
    relative_positions: {max_distance: 16, values: false, attention: [encoder_self]}  # Shaw
"""

import json
import os
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple

import yaml

from .fixed_masks import MaskBounds, parse_mask
from .gaussian import WINDOW_STRATEGIES

ATTENTION_TYPES = ("encoder_self", "decoder_self", "decoder_cross")
SELF_ATTENTION_TYPES = ("encoder_self", "decoder_self")
_META_KEYS = ("name", "description")
# layers: {attention type: layer selector} whose every head gets the Gaussian bias
LOCALNESS_DEFAULTS = {"window": "query", "fixed_window": 10.0, "max_window": 50.0, "layers": {}}
RELATIVE_POSITION_DEFAULTS = {
    "max_distance": None,
    "values": False,
    "attention": ["encoder_self", "decoder_self"],
}
PRESET_DIR_CANDIDATES = (
    os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "locality"),  # installed
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "configs", "locality"
    ),
)


class LocalitySpecError(ValueError):
    """A locality spec that cannot describe the model it is given."""


@dataclass(frozen=True)
class HeadSpec:
    mask: str = "global"
    # (layer, head) whose Wq/Wk this head uses; None: the head owns its Wq/Wk.
    qk_owner: Optional[Tuple[int, int]] = None
    gaussian: bool = False  # Yang et al.'s localness bias on this head's logits

    @property
    def bounds(self) -> MaskBounds:
        return parse_mask(self.mask)

    @property
    def token(self) -> str:
        """The head written back in spec syntax, with its owner resolved."""
        text = "gaussian" if self.gaussian and self.mask == "global" else self.mask
        if self.gaussian and self.mask != "global":
            text += "+gaussian"
        if self.qk_owner:
            text += f"@{self.qk_owner[0]}.{self.qk_owner[1]}"
        return text


def preset_dir() -> Optional[str]:
    for path in PRESET_DIR_CANDIDATES:
        if os.path.isdir(path):
            return path
    return None


def preset_names():
    path = preset_dir()
    if path is None:
        return []
    return sorted(f[: -len(".yaml")] for f in os.listdir(path) if f.endswith(".yaml"))


def load_spec_config(value) -> dict:
    """A raw spec mapping from a preset name, a YAML/JSON file, an inline YAML mapping or a dict."""
    if value is None or value == "":
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    if value in preset_names():
        return _read_yaml(os.path.join(preset_dir(), value + ".yaml"))
    if os.path.isfile(value):
        return _read_yaml(value)
    try:
        data = yaml.safe_load(value)
    except yaml.YAMLError:
        data = None
    if not isinstance(data, dict):
        raise LocalitySpecError(
            f"locality config {value!r} is neither a preset ({', '.join(preset_names())}), "
            "an existing YAML file, nor an inline YAML mapping"
        )
    return data


def _read_yaml(path):
    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise LocalitySpecError(f"locality config {path}: not valid YAML ({e})") from e
    if not isinstance(data, dict):
        raise LocalitySpecError(f"locality config {path}: expected a mapping at the top level")
    return data


def _canonical(config):
    """Layer selectors as strings (YAML reads ``0:`` as an int), so the spec round-trips JSON."""
    return {
        key: (
            {str(sel): heads for sel, heads in value.items()}
            if key in ATTENTION_TYPES and isinstance(value, Mapping)
            else value
        )
        for key, value in config.items()
    }


def _layer_indices(selector, num_layers, where):
    if str(selector).strip() == "all":
        return list(range(num_layers))
    else:
        parts = []
        for piece in str(selector).split(","):
            piece = piece.strip()
            try:
                if "-" in piece[1:]:
                    a, b = piece.split("-", 1)
                    parts.extend(range(int(a), int(b) + 1))
                else:
                    parts.append(int(piece))
            except ValueError:
                raise LocalitySpecError(
                    f"{where}: layer selector {selector!r} is not N, 'A-B', 'A,B' or 'all'"
                ) from None
    for layer in parts:
        if not 0 <= layer < num_layers:
            raise LocalitySpecError(
                f"{where}: layer {layer} does not exist; the model has {num_layers} layers "
                f"(numbered 0-{num_layers - 1})"
            )
    return parts


def _parse_head(token, layer, where):
    if not isinstance(token, str):
        raise LocalitySpecError(f"{where}: head entry {token!r} is not a string")
    mechanisms, _, owner = token.strip().partition("@")
    parts = mechanisms.split("+")
    gaussian = "gaussian" in parts
    masks = [p for p in parts if p != "gaussian"]
    if len(masks) > 1 or parts.count("gaussian") > 1:
        raise LocalitySpecError(f"{where}: {token!r} combines more than one mask")
    mask = masks[0] if masks else "global"
    try:
        parse_mask(mask)
    except ValueError as e:
        raise LocalitySpecError(f"{where}: {e}") from None
    if not owner:
        return HeadSpec(mask, None, gaussian)
    try:
        if "." in owner:
            owner_layer, owner_head = (int(x) for x in owner.split("."))
        else:
            owner_layer, owner_head = layer, int(owner)
    except ValueError:
        raise LocalitySpecError(
            f"{where}: owner {owner!r} in {token!r} is not H or L.H (head, or layer.head)"
        ) from None
    return HeadSpec(mask, (owner_layer, owner_head), gaussian)


class LocalitySpec:
    """A validated spec for one model: ``heads(attention_type, layer)`` answers every question."""

    def __init__(self, config, num_layers: Mapping[str, int], num_heads: Mapping[str, int]):
        self.config = _canonical(load_spec_config(config))
        self.name = self.config.get("name")
        self.num_layers = dict(num_layers)
        self.num_heads = dict(num_heads)
        self._layers: Dict[str, Dict[int, Tuple[HeadSpec, ...]]] = {}
        layer_wide = ("localness", "relative_positions")
        unknown = set(self.config) - set(ATTENTION_TYPES) - set(_META_KEYS) - set(layer_wide)
        if unknown:
            raise LocalitySpecError(
                f"locality config: unknown key(s) {sorted(unknown)}; expected "
                f"{', '.join(ATTENTION_TYPES + layer_wide)} (and optionally name, description)"
            )
        self.localness = self._settings("localness", LOCALNESS_DEFAULTS)
        if self.localness["window"] not in WINDOW_STRATEGIES:
            raise LocalitySpecError(
                f"localness: unknown window strategy {self.localness['window']!r}; expected "
                f"one of {', '.join(WINDOW_STRATEGIES)}"
            )
        for key in ("fixed_window", "max_window"):
            value = self.localness[key]
            if not isinstance(value, (int, float)) or value <= 0:
                raise LocalitySpecError(
                    f"localness: {key} must be a positive number, got {value!r}"
                )
        self.relative_positions = self._settings("relative_positions", RELATIVE_POSITION_DEFAULTS)
        self._check_relative_positions()
        for attn_type in ATTENTION_TYPES:
            self._layers[attn_type] = self._parse_type(attn_type, self.config.get(attn_type) or {})
        for attn_type in ATTENTION_TYPES:
            self._resolve_owners(attn_type)
        self._add_gaussian_layers()

    # -- parsing and validation -------------------------------------------------------------
    def _settings(self, key, defaults):
        given = self.config.get(key) or {}
        if not isinstance(given, Mapping):
            raise LocalitySpecError(f"locality config: {key} must be a mapping")
        unknown = set(given) - set(defaults)
        if unknown:
            raise LocalitySpecError(
                f"{key}: unknown setting(s) {sorted(unknown)}; expected {', '.join(defaults)}"
            )
        return {**defaults, **given}

    def _add_gaussian_layers(self):
        """``localness.layers`` gives every head of the named layers the Gaussian bias."""
        layers = self.localness["layers"]
        if not isinstance(layers, Mapping):
            raise LocalitySpecError("localness: layers must map attention types to layer selectors")
        for attn_type, selector in layers.items():
            if attn_type not in ATTENTION_TYPES:
                raise LocalitySpecError(
                    f"localness: unknown attention type {attn_type!r} in layers; expected "
                    f"{', '.join(ATTENTION_TYPES)}"
                )
            if attn_type not in self.num_layers:
                raise LocalitySpecError(f"localness: this model has no {attn_type} attention")
            where = f"localness layers {attn_type}"
            for layer in _layer_indices(selector, self.num_layers[attn_type], where):
                self._layers[attn_type][layer] = tuple(
                    HeadSpec(h.mask, h.qk_owner, True) for h in self.heads(attn_type, layer)
                )

    def _check_relative_positions(self):
        rel = self.relative_positions
        k = rel["max_distance"]
        if k is None:
            return
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise LocalitySpecError(
                f"relative_positions: max_distance must be an integer >= 1, got {k!r}"
            )
        if isinstance(rel["attention"], str):
            rel["attention"] = [a.strip() for a in rel["attention"].split(",")]
        for attn_type in rel["attention"]:
            if attn_type not in SELF_ATTENTION_TYPES:
                raise LocalitySpecError(
                    f"relative_positions: {attn_type!r} is not a self-attention type "
                    f"({', '.join(SELF_ATTENTION_TYPES)})"
                )

    def _parse_type(self, attn_type, layers_cfg):
        if not isinstance(layers_cfg, Mapping):
            raise LocalitySpecError(
                f"locality config: {attn_type} must map layer selectors to head lists"
            )
        if layers_cfg and attn_type not in self.num_layers:
            raise LocalitySpecError(f"locality config: this model has no {attn_type} attention")
        parsed = {}
        for selector, heads in layers_cfg.items():
            n_layers, n_heads = self.num_layers[attn_type], self.num_heads[attn_type]
            where = f"{attn_type} layer {selector}"
            if isinstance(heads, str):
                heads = heads.split()
            if not isinstance(heads, (list, tuple)):
                raise LocalitySpecError(f"{where}: expected a list of heads, got {heads!r}")
            if len(heads) != n_heads:
                raise LocalitySpecError(
                    f"{where}: lists {len(heads)} heads but the model has {n_heads} "
                    f"{attn_type} attention heads"
                )
            for layer in _layer_indices(selector, n_layers, where):
                if layer in parsed:
                    raise LocalitySpecError(f"{attn_type} layer {layer} is given more than once")
                parsed[layer] = tuple(
                    _parse_head(tok, layer, f"{attn_type} layer {layer} head {h}")
                    for h, tok in enumerate(heads)
                )
                self._check_masks(attn_type, layer, parsed[layer])
        return parsed

    @staticmethod
    def _check_masks(attn_type, layer, heads):
        for h, head in enumerate(heads):
            where = f"{attn_type} layer {layer} head {h}"
            bounds = head.bounds
            if attn_type == "decoder_cross" and not bounds.is_global:
                raise LocalitySpecError(
                    f"{where}: mask {head.mask!r} needs queries and keys from one sequence; "
                    "cross-attention heads can only be global (tying is allowed)"
                )
            if attn_type == "decoder_self" and bounds.lo is not None and bounds.lo > 0:
                raise LocalitySpecError(
                    f"{where}: mask {head.mask!r} attends only to future tokens, which the "
                    "decoder's causal mask hides"
                )

    def _resolve_owners(self, attn_type):
        """Replace chains of ties by the head that owns the Wq/Wk; reject dangling or cyclic ties."""
        layers = self._layers[attn_type]
        if not layers:
            return
        n_layers, n_heads = self.num_layers[attn_type], self.num_heads[attn_type]

        def owner_of(layer, head):
            seen = [(layer, head)]
            while True:
                spec = self.heads(attn_type, layer)[head]
                if spec.qk_owner is None:
                    return (layer, head)
                nxt_layer, nxt_head = spec.qk_owner
                where = f"{attn_type} layer {layer} head {head}"
                if not 0 <= nxt_layer < n_layers:
                    raise LocalitySpecError(
                        f"{where} ties to layer {nxt_layer}, which does not exist "
                        f"({n_layers} layers)"
                    )
                if not 0 <= nxt_head < n_heads:
                    raise LocalitySpecError(
                        f"{where} ties to head {nxt_head}, which does not exist ({n_heads} heads)"
                    )
                if (nxt_layer, nxt_head) in seen:
                    if (nxt_layer, nxt_head) == (layer, head) and len(seen) == 1:
                        return (layer, head)  # tied to itself: simply owns its Wq/Wk
                    raise LocalitySpecError(f"{where}: ties form a cycle {seen}")
                seen.append((nxt_layer, nxt_head))
                layer, head = nxt_layer, nxt_head

        resolved = {}
        for layer, heads in layers.items():
            new_heads = []
            for h, spec in enumerate(heads):
                owner = owner_of(layer, h)
                new_heads.append(
                    HeadSpec(spec.mask, None if owner == (layer, h) else owner, spec.gaussian)
                )
            resolved[layer] = tuple(new_heads)
        self._layers[attn_type] = resolved

    # -- queries ----------------------------------------------------------------------------
    def heads(self, attn_type: str, layer: int) -> Tuple[HeadSpec, ...]:
        """What each head of one layer does; layers the spec does not name are plain global."""
        layers = self._layers.get(attn_type, {})
        if layer in layers:
            return layers[layer]
        return tuple(HeadSpec() for _ in range(self.num_heads[attn_type]))

    def is_local(self, attn_type: str) -> bool:
        return bool(self._layers.get(attn_type))

    def relative_max_distance(self, attn_type: str) -> Optional[int]:
        """Shaw et al.'s clipping distance for this attention type, or None without them."""
        rel = self.relative_positions
        if rel["max_distance"] is None or attn_type not in rel["attention"]:
            return None
        return rel["max_distance"]

    def to_json(self) -> str:
        """The canonical form stored in checkpoints: rebuilding from it gives the same spec."""
        return json.dumps(self.config, sort_keys=True)

    def describe(self) -> str:
        lines = [f"locality spec {self.name or '(unnamed)'}"]
        for attn_type in ATTENTION_TYPES:
            for layer in sorted(self._layers.get(attn_type, {})):
                heads = " ".join(h.token for h in self._layers[attn_type][layer])
                lines.append(f"  {attn_type} layer {layer}: {heads}")
        return "\n".join(lines)
