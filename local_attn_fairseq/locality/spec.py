"""The locality spec: what every head of every attention layer does, validated against a model.

A spec is data (a YAML/JSON mapping, a preset name, or a file) of this shape::

    name: 1loc7tied-all6
    encoder_self:                 # also decoder_self, decoder_cross
      all:                        # layer selector: N, "A-B" (A <= B), "A,B,C" or "all"
        [identity, identity@0, prev-1@0, prev-2@0, next-1@0, next-2@0, band-1@0, band-2@0]

Each head joins mechanisms with ``+`` (``MASK``, ``gaussian``, ``WINDOW``; each at most once, e.g.
``band-2+gaussian``, ``aw-seg``), optionally followed by ``@OWNER``: the mask is one of
``fixed_masks``; ``gaussian`` adds Yang et al.'s learned localness bias (settings under
``localness``); the window is Nguyen et al.'s dynamic window, ``mw`` (multiplicative) or ``aw``
(additive), token-based or ``-seg`` / ``-segB`` segment-based (B defaults to
``dynamic_window.segment_size``); the owner is the head whose Wq/Wk it uses instead of its own,
``H`` (head H of the same layer) or ``L.H`` (head H of layer L of the same attention type).
Layers a spec does not name have global heads with their own Wq/Wk, i.e. the plain Transformer.

Layer-wide mechanisms sit beside the attention types::

    localness: {window: query, centre: paper, layers: {encoder_self: 0-2}}   # Yang et al. 2018
    relative_positions: {max_distance: 16, values: false, attention: [encoder_self]}  # Shaw
    dynamic_window: {segment_size: 5, layers: {encoder_self: "aw:0-2"}}  # Nguyen et al. 2020
    head_gates: {attention: [encoder_self], temperature: 0.667, init: constant}  # Voita et al.

and ``heads_kept`` says which heads a pruned model still has, per attention type and layer
(a list over layers; each entry the kept heads' indices, or a count n for heads 0..n-1)::

    heads_kept: {encoder_self: [[0, 5], [2], [], 4, 8, 8]}

Head lists and ties always use the unpruned numbering, so pruning never rewrites them.
"""

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import yaml

from .fixed_masks import MaskBounds, parse_mask
from .gaussian import CENTRE_CONVENTIONS, DEFAULT_CENTRE_CONVENTION, WINDOW_STRATEGIES
from .head_gates import DEFAULT_GATE_INIT, DEFAULT_LOG_ALPHA_INIT, DEFAULT_TEMPERATURE, GATE_INITS
from .layer_selection import layer_selection

ATTENTION_TYPES = ("encoder_self", "decoder_self", "decoder_cross")
SELF_ATTENTION_TYPES = ("encoder_self", "decoder_self")
_META_KEYS = ("name", "description")
WINDOW_METHODS = ("mw", "aw")
DEFAULT_SEGMENT_SIZE = 5  # Nguyen et al.'s b
# The widest mask window or segment a spec may give: window arithmetic stays far inside the
# banded operator's and torch's integer range, and any real sequence is shorter.
MAX_WINDOW = 2**31 - 1
# layers: {attention type: layer selector} whose every head gets the Gaussian bias
# centre: Yang et al.'s Eqs. 6-9 ("paper") or their released code's (I - 1) sigmoid ("code")
LOCALNESS_DEFAULTS = {
    "window": "query",
    "fixed_window": 10.0,
    "max_window": 50.0,
    "centre": DEFAULT_CENTRE_CONVENTION,
    "layers": {},
}
RELATIVE_POSITION_DEFAULTS = {
    "max_distance": None,
    "values": False,
    "attention": ["encoder_self", "decoder_self"],
}
# layers: {attention type: "METHOD:LAYERS"}, e.g. {encoder_self: "aw:0-2"}: every head of the
# named layers gets the dynamic window METHOD (mw, aw, mw-seg, aw-seg, ...).
DYNAMIC_WINDOW_DEFAULTS = {"segment_size": DEFAULT_SEGMENT_SIZE, "layers": {}}
HEAD_GATE_DEFAULTS = {
    "attention": [],
    "temperature": DEFAULT_TEMPERATURE,
    "log_alpha_init": DEFAULT_LOG_ALPHA_INIT,
    "init": DEFAULT_GATE_INIT,  # constant (log_alpha_init) or glorot (Voita et al.'s code)
}
# Short names accepted by --head-gates.
ATTENTION_TYPE_ALIASES = {"enc": "encoder_self", "dec": "decoder_self", "cross": "decoder_cross"}
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
    # Nguyen et al.'s dynamic window: "mw" (multiplicative) or "aw" (additive), or None; with
    # segment-based masking of this segment size (None: token-based).
    window: Optional[str] = None
    segment: Optional[int] = None

    @property
    def bounds(self) -> MaskBounds:
        return parse_mask(self.mask)

    @property
    def token(self) -> str:
        """The head written back in spec syntax, with its owner resolved."""
        parts = [] if self.mask == "global" else [self.mask]
        if self.gaussian:
            parts.append("gaussian")
        if self.window:
            parts.append(self.window + (f"-seg{self.segment}" if self.segment else ""))
        text = "+".join(parts) or "global"
        if self.qk_owner:
            text += f"@{self.qk_owner[0]}.{self.qk_owner[1]}"
        return text

    def replace(self, **changes) -> "HeadSpec":
        return dataclasses.replace(self, **changes)


def parse_window(token: str, segment_size: int = DEFAULT_SEGMENT_SIZE):
    """``mw``, ``aw``, ``mw-seg``, ``aw-seg3`` -> (method, segment size or None), or None when the
    token is not a dynamic-window method."""
    method, _, segment = token.partition("-")
    if method not in WINDOW_METHODS:
        return None
    if not segment:
        return method, None
    if not segment.startswith("seg"):
        raise LocalitySpecError(
            f"{token!r}: a dynamic window is mw or aw, optionally -seg or -segB (segment size B)"
        )
    size = segment[len("seg") :]
    if size and (not size.isdigit() or int(size) < 1):
        raise LocalitySpecError(f"{token!r}: the segment size must be a positive integer")
    if size and int(size) > MAX_WINDOW:
        raise LocalitySpecError(f"{token!r}: the segment size must be at most {MAX_WINDOW}")
    return method, int(size) if size else segment_size


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
        data = yaml.load(value, Loader=_UniqueKeyLoader)
    except yaml.YAMLError:
        data = None
    if not isinstance(data, dict):
        raise LocalitySpecError(
            f"locality config {value!r} is neither a preset ({', '.join(preset_names())}), "
            "an existing YAML file, nor an inline YAML mapping"
        )
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader refusing a key given twice in one mapping (PyYAML would keep the last)."""

    def construct_mapping(self, node, deep=False):
        first_line = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in first_line:
                    raise LocalitySpecError(
                        f"duplicate key {key!r} on line {line} (first given on line "
                        f"{first_line[key]}); a mapping takes each key once: merge the entries"
                    )
                first_line[key] = line
            except TypeError:  # an unhashable key: SafeLoader reports it below
                continue
        return super().construct_mapping(node, deep)


def _read_yaml(path):
    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.load(f, Loader=_UniqueKeyLoader)
        except yaml.YAMLError as e:
            raise LocalitySpecError(f"locality config {path}: not valid YAML ({e})") from e
        except LocalitySpecError as e:
            raise LocalitySpecError(f"locality config {path}: {e}") from None
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
    try:
        return layer_selection(selector, num_layers)
    except ValueError as error:
        raise LocalitySpecError(f"{where}: {error}") from None


def _parse_head(token, layer, where, segment_size=DEFAULT_SEGMENT_SIZE):
    if not isinstance(token, str):
        raise LocalitySpecError(f"{where}: head entry {token!r} is not a string")
    mechanisms, _, owner = token.strip().partition("@")
    parts = mechanisms.split("+")
    gaussian = "gaussian" in parts
    try:
        windows = [w for w in (parse_window(p, segment_size) for p in parts) if w]
    except LocalitySpecError as e:
        raise LocalitySpecError(f"{where}: {e}") from None
    masks = [p for p in parts if p != "gaussian" and not parse_window(p)]
    if len(masks) > 1 or parts.count("gaussian") > 1:
        raise LocalitySpecError(f"{where}: {token!r} combines more than one mask")
    if len(windows) > 1:
        raise LocalitySpecError(f"{where}: {token!r} combines more than one dynamic window")
    mask = masks[0] if masks else "global"
    window, segment = windows[0] if windows else (None, None)
    try:
        bounds = parse_mask(mask)
    except ValueError as e:
        raise LocalitySpecError(f"{where}: {e}") from None
    widest = max((abs(b) for b in (bounds.lo, bounds.hi) if b is not None), default=0)
    if widest > MAX_WINDOW:
        raise LocalitySpecError(
            f"{where}: mask {mask!r} has a window of {widest}; windows are at most {MAX_WINDOW} "
            "(a window longer than every sentence covers it all: use global, or the longest "
            "sentence's length)"
        )
    head = HeadSpec(mask, None, gaussian, window, segment)
    if not owner:
        return head
    try:
        if "." in owner:
            owner_layer, owner_head = (int(x) for x in owner.split("."))
        else:
            owner_layer, owner_head = layer, int(owner)
    except ValueError:
        raise LocalitySpecError(
            f"{where}: owner {owner!r} in {token!r} is not H or L.H (head, or layer.head)"
        ) from None
    return head.replace(qk_owner=(owner_layer, owner_head))


class LocalitySpec:
    """A validated spec for one model: ``heads(attention_type, layer)`` answers every question."""

    def __init__(self, config, num_layers: Mapping[str, int], num_heads: Mapping[str, int]):
        self.config = _canonical(load_spec_config(config))
        self.name = self.config.get("name")
        self.num_layers = dict(num_layers)
        self.num_heads = dict(num_heads)
        self._layers: Dict[str, Dict[int, Tuple[HeadSpec, ...]]] = {}
        layer_wide = (
            "localness",
            "relative_positions",
            "dynamic_window",
            "head_gates",
            "heads_kept",
        )
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
        if self.localness["centre"] not in CENTRE_CONVENTIONS:
            raise LocalitySpecError(
                f"localness: unknown centre convention {self.localness['centre']!r}; expected "
                f"one of {', '.join(CENTRE_CONVENTIONS)}"
            )
        for key in ("fixed_window", "max_window"):
            value = self.localness[key]
            if not isinstance(value, (int, float)) or value <= 0:
                raise LocalitySpecError(
                    f"localness: {key} must be a positive number, got {value!r}"
                )
        self.relative_positions = self._settings("relative_positions", RELATIVE_POSITION_DEFAULTS)
        self._check_relative_positions()
        self.dynamic_window = self._settings("dynamic_window", DYNAMIC_WINDOW_DEFAULTS)
        segment_size = self.dynamic_window["segment_size"]
        if isinstance(segment_size, bool) or not isinstance(segment_size, int) or segment_size < 1:
            raise LocalitySpecError(
                f"dynamic_window: segment_size must be an integer >= 1, got {segment_size!r}"
            )
        for attn_type in ATTENTION_TYPES:
            self._layers[attn_type] = self._parse_type(attn_type, self.config.get(attn_type) or {})
        for attn_type in ATTENTION_TYPES:
            self._resolve_owners(attn_type)
        self._add_gaussian_layers()
        self._add_window_layers()
        self.head_gates = self._settings("head_gates", HEAD_GATE_DEFAULTS)
        self._check_head_gates()
        self._kept = self._parse_heads_kept(self.config.get("heads_kept") or {})

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
                    h.replace(gaussian=True) for h in self.heads(attn_type, layer)
                )

    def _add_window_layers(self):
        """``dynamic_window.layers`` gives every head of the named layers a dynamic window."""
        layers = self.dynamic_window["layers"]
        if not isinstance(layers, Mapping):
            raise LocalitySpecError(
                "dynamic_window: layers must map attention types to 'METHOD:LAYERS' strings"
            )
        for attn_type, entry in layers.items():
            where = f"dynamic_window layers {attn_type}"
            if attn_type not in ATTENTION_TYPES or attn_type not in self.num_layers:
                raise LocalitySpecError(f"{where}: not an attention type of this model")
            method, sep, selector = str(entry).partition(":")
            window = parse_window(method, self.dynamic_window["segment_size"]) if sep else None
            if window is None:
                raise LocalitySpecError(
                    f"{where}: {entry!r} is not METHOD:LAYERS with METHOD mw, aw, mw-seg or "
                    "aw-seg (e.g. aw:0-2)"
                )
            for layer in _layer_indices(selector, self.num_layers[attn_type], where):
                heads = tuple(
                    h.replace(window=window[0], segment=window[1])
                    for h in self.heads(attn_type, layer)
                )
                self._check_masks(attn_type, layer, heads)
                self._layers[attn_type][layer] = heads

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
        if not rel["attention"]:  # max_distance on no attention type would change nothing
            raise LocalitySpecError(
                "relative_positions: attention names no attention type; give encoder_self "
                "and/or decoder_self, or leave out max_distance"
            )
        for attn_type in rel["attention"]:
            if attn_type not in SELF_ATTENTION_TYPES:
                raise LocalitySpecError(
                    f"relative_positions: {attn_type!r} is not a self-attention type "
                    f"({', '.join(SELF_ATTENTION_TYPES)})"
                )

    def _check_head_gates(self):
        gates = self.head_gates
        types = gates["attention"]
        if isinstance(types, str):
            types = [t.strip() for t in types.split(",") if t.strip()]
            if not types:  # [] is how a spec says "no gates"; a string names types
                raise LocalitySpecError(
                    f"head_gates: attention {gates['attention']!r} names no attention type; "
                    f"give {', '.join(ATTENTION_TYPES)} (or enc, dec, cross), or [] for none"
                )
        types = [ATTENTION_TYPE_ALIASES.get(t, t) for t in types]
        for attn_type in types:
            if attn_type not in ATTENTION_TYPES:
                raise LocalitySpecError(
                    f"head_gates: unknown attention type {attn_type!r}; expected "
                    f"{', '.join(ATTENTION_TYPES)} (or enc, dec, cross)"
                )
            if attn_type not in self.num_layers:
                raise LocalitySpecError(f"head_gates: this model has no {attn_type} attention")
        gates["attention"] = [t for t in ATTENTION_TYPES if t in types]
        temperature = gates["temperature"]
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise LocalitySpecError(
                f"head_gates: temperature must be a number, got {temperature!r}"
            )
        if temperature <= 0:
            raise LocalitySpecError(f"head_gates: temperature must be positive, got {temperature}")
        if not isinstance(gates["log_alpha_init"], (int, float)):
            raise LocalitySpecError("head_gates: log_alpha_init must be a number")
        if gates["init"] not in GATE_INITS:
            raise LocalitySpecError(
                f"head_gates: unknown init {gates['init']!r}; expected {' or '.join(GATE_INITS)}"
            )

    def _parse_heads_kept(self, kept_cfg):
        if not isinstance(kept_cfg, Mapping):
            raise LocalitySpecError("heads_kept: must map attention types to per-layer lists")
        kept = {}
        for attn_type, per_layer in kept_cfg.items():
            if attn_type not in ATTENTION_TYPES or attn_type not in self.num_layers:
                raise LocalitySpecError(
                    f"heads_kept: {attn_type!r} is not an attention type of this model"
                )
            n_layers, n_heads = self.num_layers[attn_type], self.num_heads[attn_type]
            if not isinstance(per_layer, (list, tuple)) or len(per_layer) != n_layers:
                raise LocalitySpecError(
                    f"heads_kept {attn_type}: expected a list of {n_layers} entries (one per "
                    f"layer), got {per_layer!r}"
                )
            kept[attn_type] = tuple(
                self._kept_in_layer(entry, n_heads, f"heads_kept {attn_type} layer {layer}")
                for layer, entry in enumerate(per_layer)
            )
        return kept

    @staticmethod
    def _kept_in_layer(entry, n_heads, where):
        if isinstance(entry, int) and not isinstance(entry, bool):
            if not 0 <= entry <= n_heads:
                raise LocalitySpecError(f"{where}: {entry} heads, but layers have {n_heads}")
            return tuple(range(entry))
        if not isinstance(entry, (list, tuple)) or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in entry
        ):
            raise LocalitySpecError(f"{where}: expected a head count or a list of head indices")
        if len(set(entry)) != len(entry) or any(not 0 <= h < n_heads for h in entry):
            raise LocalitySpecError(
                f"{where}: head indices {list(entry)} must be distinct and in 0-{n_heads - 1}"
            )
        return tuple(sorted(entry))

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
                    _parse_head(
                        tok,
                        layer,
                        f"{attn_type} layer {layer} head {h}",
                        self.dynamic_window["segment_size"],
                    )
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
            if attn_type == "decoder_self" and head.segment:
                raise LocalitySpecError(
                    f"{where}: segment-based windows need whole segments of keys, which the "
                    "decoder's self-attention does not have yet; use mw or aw (token-based)"
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
                if (nxt_layer, nxt_head) == (layer, head):
                    # tied to itself (e.g. "all: [..., global@0.7]" in layer 0): owns its Wq/Wk
                    return (layer, head)
                if (nxt_layer, nxt_head) in seen:
                    raise LocalitySpecError(f"{where}: ties form a cycle {seen}")
                seen.append((nxt_layer, nxt_head))
                layer, head = nxt_layer, nxt_head

        resolved = {}
        for layer, heads in layers.items():
            new_heads = []
            for h, spec in enumerate(heads):
                owner = owner_of(layer, h)
                new_heads.append(spec.replace(qk_owner=None if owner == (layer, h) else owner))
            resolved[layer] = tuple(new_heads)
        self._layers[attn_type] = resolved

    # -- queries ----------------------------------------------------------------------------
    def heads(self, attn_type: str, layer: int) -> Tuple[HeadSpec, ...]:
        """What each head of one layer does; layers the spec does not name are plain global."""
        layers = self._layers.get(attn_type, {})
        if layer in layers:
            return layers[layer]
        return tuple(HeadSpec() for _ in range(self.num_heads[attn_type]))

    def kept_heads(self, attn_type: str, layer: int) -> Tuple[int, ...]:
        """The heads (unpruned numbering) that this layer has; all of them unless pruned."""
        kept = self._kept.get(attn_type)
        return kept[layer] if kept else tuple(range(self.num_heads[attn_type]))

    def qk_rows(self, attn_type: str, layer: int) -> Tuple[int, ...]:
        """The heads of this layer whose Wq/Wk the layer holds.

        That is every head owning its Wq/Wk that a kept head of any layer uses, even when the
        head itself was pruned; a layer with Gaussian heads keeps all of its queries, since the
        localness projections read the layer's whole query vector.
        """
        needed = set()
        for other in range(self.num_layers[attn_type]):
            heads = self.heads(attn_type, other)
            users = self._query_heads(attn_type, other)
            for h in users:
                owner = heads[h].qk_owner or (other, h)
                if owner[0] == layer:
                    needed.add(owner[1])
        return tuple(sorted(needed))

    def _query_heads(self, attn_type: str, layer: int) -> Tuple[int, ...]:
        """The heads whose queries and keys the layer computes."""
        if any(h.gaussian for h in self.heads(attn_type, layer)):
            return tuple(range(self.num_heads[attn_type]))
        return self.kept_heads(attn_type, layer)

    def is_pruned(self) -> bool:
        return bool(self._kept)

    def gate_settings(self, attn_type: str) -> Optional[dict]:
        """Hard Concrete settings when this attention type has head gates, else None."""
        if attn_type not in self.head_gates["attention"]:
            return None
        return {k: v for k, v in self.head_gates.items() if k != "attention"}

    def is_local(self, attn_type: str) -> bool:
        return bool(self._layers.get(attn_type))

    def relative_max_distance(self, attn_type: str) -> Optional[int]:
        """Shaw et al.'s clipping distance for this attention type, or None without them."""
        rel = self.relative_positions
        if rel["max_distance"] is None or attn_type not in rel["attention"]:
            return None
        return rel["max_distance"]

    def keep_layers(self, kept: Mapping[str, Sequence[int]], origin: str) -> "LocalitySpec":
        """The spec of a model cut down to some layers, as fairseq's ``*_layers_to_keep`` does.

        ``kept`` maps attention types to the original indices of the layers that stay, which
        fairseq renumbers 0, 1, ... in order. Each kept layer keeps its heads, their mechanisms,
        their kept heads and their ties (renumbered); a tie to a removed layer is refused,
        since the Wq/Wk it uses are gone with that layer. ``origin`` names the setting in
        messages.
        """
        config = json.loads(self.to_json())
        num_layers = dict(self.num_layers)
        renumbered = {}
        for attn_type, layers in kept.items():
            layers = self._check_kept_layers(attn_type, layers, origin)
            new_index = {old: new for new, old in enumerate(layers)}
            renumbered[attn_type] = new_index
            explicit = {}
            for old in layers:
                if old not in self._layers[attn_type]:
                    continue
                tokens = []
                for h, head in enumerate(self._layers[attn_type][old]):
                    if head.qk_owner is not None:
                        owner_layer, owner_head = head.qk_owner
                        if owner_layer not in new_index:
                            raise LocalitySpecError(
                                f"{origin}: {attn_type} layer {old} head {h} uses the Wq/Wk of "
                                f"layer {owner_layer} head {owner_head}, which would be removed; "
                                f"keep layer {owner_layer} as well"
                            )
                        head = head.replace(qk_owner=(new_index[owner_layer], owner_head))
                    tokens.append(head.token)
                explicit[str(new_index[old])] = tokens
            config[attn_type] = explicit
            # Layer-wide settings are already in the explicit heads; keep them, renumbered, so
            # that an arch's defaults ("unless the spec names this type") still see them.
            for key in ("localness", "dynamic_window"):
                by_type = (config.get(key) or {}).get("layers") or {}
                if attn_type in by_type:
                    self._renumber_layer_setting(key, by_type, attn_type, new_index)
            if attn_type in self._kept:
                config["heads_kept"][attn_type] = [list(self._kept[attn_type][i]) for i in layers]
            num_layers[attn_type] = len(layers)
        spec = LocalitySpec(config, num_layers, self.num_heads)
        for attn_type, new_index in renumbered.items():
            for old, new in new_index.items():
                lost = set(self.qk_rows(attn_type, old)) - set(spec.qk_rows(attn_type, new))
                if lost:
                    raise LocalitySpecError(
                        f"{origin}: {attn_type} layer {old} holds the Wq/Wk of pruned heads "
                        f"{sorted(lost)} for layers that would be removed; keep those layers too"
                    )
        return spec

    def _check_kept_layers(self, attn_type, layers, origin) -> List[int]:
        n_layers = self.num_layers[attn_type]
        layers = list(layers)
        if not layers:
            raise LocalitySpecError(f"{origin}: keeps no layer; keep at least one")
        if len(set(layers)) != len(layers):
            raise LocalitySpecError(f"{origin}: names a layer more than once ({layers})")
        for layer in layers:
            if not 0 <= layer < n_layers:
                raise LocalitySpecError(
                    f"{origin}: layer {layer} does not exist; the model has {n_layers} "
                    f"{attn_type} layers (numbered 0-{n_layers - 1})"
                )
        return sorted(layers)

    def _renumber_layer_setting(self, key, by_type, attn_type, new_index):
        """One ``localness.layers`` / ``dynamic_window.layers`` entry, for the kept layers."""
        value = str(by_type[attn_type])
        prefix, selector = ("", value)
        if key == "dynamic_window":
            method, _, selector = value.partition(":")
            prefix = method + ":"
        old_layers = _layer_indices(selector, self.num_layers[attn_type], f"{key} layers")
        kept = [str(new_index[old]) for old in old_layers if old in new_index]
        if kept:
            by_type[attn_type] = prefix + ",".join(kept)
        else:
            del by_type[attn_type]

    def to_json(self) -> str:
        """The canonical form stored in checkpoints: rebuilding from it gives the same spec."""
        return json.dumps(self.config, sort_keys=True)

    def describe(self) -> str:
        lines = [f"locality spec {self.name or '(unnamed)'}"]
        for attn_type in ATTENTION_TYPES:
            for layer in sorted(self._layers.get(attn_type, {})):
                heads = " ".join(h.token for h in self._layers[attn_type][layer])
                lines.append(f"  {attn_type} layer {layer}: {heads}")
        for attn_type, per_layer in self._kept.items():
            counts = "/".join(str(len(heads)) for heads in per_layer)
            lines.append(f"  {attn_type} heads kept per layer: {counts}")
        if self.head_gates["attention"]:
            lines.append(f"  head gates on {', '.join(self.head_gates['attention'])}")
        return "\n".join(lines)
