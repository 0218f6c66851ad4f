"""What every model of the plugin shares: the locality options on the command line, the spec
they build for a model of a given shape, the dynamic-window defaults of the archs, and the
head-gate queries the L0 criterion makes.
"""

import json
import logging
import os

from fairseq.models import ARCH_MODEL_REGISTRY

from .. import cli_types
from ..checkpoint_files import current_fairseq_train_run
from ..criterions.l0_penalty import adds_l0_penalty, l0_criterion_names
from ..locality import head_gates
from ..locality.gaussian import CENTRE_CONVENTIONS, WINDOW_STRATEGIES
from ..locality.spec import LocalitySpec, LocalitySpecError, load_spec_config, preset_names

logger = logging.getLogger(__name__)


def locality_spec_for_attention(cfg, num_layers: dict, num_heads: dict, model_name: str):
    """The validated spec, from the locality options, of a model with the attention types (and
    their layer and head counts) in ``num_layers`` and ``num_heads``: settings for a type the
    model lacks (a language model has no encoder) are refused."""
    types = ", ".join(num_layers)
    try:
        config = with_command_line_settings(
            load_spec_config(getattr(cfg, "locality_config", None)), cfg
        )
        _check_relative_position_types(config, num_layers)
        return LocalitySpec(config, num_layers, num_heads)
    except LocalitySpecError as e:
        raise LocalitySpecError(
            f"invalid locality spec (--locality-config and the options that add to it) for "
            f"{model_name} (attention types: {types}): {e}"
        ) from None


def settle_spec(args, spec: LocalitySpec) -> LocalitySpec:
    """What a model's build_model does with its validated spec: keep the layers that
    ``--*-layers-to-keep`` leave, store the spec in ``args`` (a checkpoint rebuilds the model
    from it) and log it; under fairseq-train, warn when head gates would train without the L0
    penalty, which only the ``*_l0`` criteria add (Voita et al. train the gates with it)."""
    spec = keep_layers_of_spec(args, spec)
    args.locality_config = spec.to_json()
    logger.info(spec.describe())
    gated = spec.head_gates["attention"]
    criterion = getattr(args, "criterion", None)
    if gated and current_fairseq_train_run() is not None and not adds_l0_penalty(criterion):
        logger.warning(
            f"head gates on {', '.join(gated)} train without the L0 penalty: --criterion "
            f"{criterion} does not add it; {' or '.join(l0_criterion_names())} does (its "
            "--l0-lambda 0 trains the gates without it on purpose)"
        )
    return spec


# fairseq's LayerDrop pruning options: the attention types each one cuts, and the layer count
# it sets (as fairseq's own models do when they build the shorter stack).
LAYERS_TO_KEEP_OPTIONS = {
    "encoder_layers_to_keep": (("encoder_self",), "encoder_layers"),
    "decoder_layers_to_keep": (("decoder_self", "decoder_cross"), "decoder_layers"),
}
# Command-line settings that address layers by number; a cut-down spec holds their effect.
LAYER_ADDRESSED_OPTIONS = ("localness_layers", "dynamic_window", "heads_kept")


def keep_layers_of_spec(args, spec: LocalitySpec) -> LocalitySpec:
    """The spec of the layers that ``--*-layers-to-keep`` (usually given at load time through
    ``--model-overrides``) leaves, written back to ``args.locality_config``.

    fairseq then builds the shorter stack and renames the checkpoint's layers to match; the spec
    must follow, so each kept layer keeps its own heads and ties. A spec that already describes
    the shorter stack (a model rebuilt from its own arguments) is left as it is.
    """
    kept, counts, given = {}, {}, []
    for option, (attn_types, count) in LAYERS_TO_KEEP_OPTIONS.items():
        value = getattr(args, option, None)
        present = [t for t in attn_types if t in spec.num_layers]
        if not value or not present:
            continue
        # A string through --model-overrides; a list of ints from the command line, which
        # fairseq's own code (it splits on commas) takes only as a string.
        items = value if isinstance(value, (list, tuple)) else str(value).split(",")
        try:
            layers = [int(x) for x in items]
            setattr(args, option, ",".join(map(str, layers)))
        except (TypeError, ValueError):
            raise LocalitySpecError(
                f"{option}={value!r}: expected comma-separated layer numbers, e.g. 0,2,4"
            ) from None
        if len(layers) == spec.num_layers[present[0]]:
            continue
        kept.update({t: layers for t in present})
        counts[count] = len(layers)
        given.append(f"{option}={getattr(args, option)}")
    if not kept:
        return spec
    had_windows = bool(spec.dynamic_window["layers"] or getattr(args, "dynamic_window", None))
    spec = spec.keep_layers(kept, ", ".join(given))
    # fairseq's prune_state_dict drops every layer of a stack it has no list for: the other
    # stack of an encoder-decoder model is kept whole by naming all of its layers.
    for option, (attn_types, _) in LAYERS_TO_KEEP_OPTIONS.items():
        if attn_types[0] in spec.num_layers and not getattr(args, option, None):
            setattr(args, option, ",".join(map(str, range(spec.num_layers[attn_types[0]]))))
    args.locality_config = spec.to_json()
    for count, value in counts.items():
        setattr(args, count, value)
    for option in LAYER_ADDRESSED_OPTIONS:
        if hasattr(args, option):
            setattr(args, option, None)
    if had_windows:
        # A type whose kept layers have no window must say so: the cut spec no longer names
        # it, and a dynwin arch would give it its default windows again when it is rebuilt.
        windowless = [t for t in spec.num_layers if t not in spec.dynamic_window["layers"]]
        args.dynamic_window = " ".join(f"{t}:none" for t in windowless) or None
    return spec


def _check_relative_position_types(config: dict, num_layers: dict):
    """Relative positions default to both self-attention types, so the spec ignores a missing
    one; a type the user names explicitly must exist, or the setting would silently vanish."""
    named = (config.get("relative_positions") or {}).get("attention")
    if isinstance(named, str):
        named = [t.strip() for t in named.split(",")]
    missing = [t for t in named or [] if t not in num_layers]
    if missing:
        raise LocalitySpecError(
            f"relative_positions: this model has no {', '.join(missing)} attention"
        )


def with_command_line_settings(config: dict, cfg) -> dict:
    """The spec with the --localness-* and --relative-positions* options written into it.

    Setting a key to the same value twice changes nothing, so rebuilding a model from a
    checkpoint (whose stored spec already holds these settings) gives the same spec.
    """
    config = dict(config)
    localness = dict(config.get("localness") or {})
    for option, key in (
        ("localness_window", "window"),
        ("localness_fixed_window", "fixed_window"),
        ("localness_max_window", "max_window"),
        ("localness_centre", "centre"),
    ):
        if getattr(cfg, option, None) is not None:
            localness[key] = getattr(cfg, option)
    # "is not None": an empty value selects nothing and is refused, not skipped
    if getattr(cfg, "localness_layers", None) is not None:
        layers = dict(localness.get("layers") or {})
        layers.update(_read_option(cli_types.localness_layers, cfg.localness_layers))
        localness["layers"] = layers
    if localness:
        config["localness"] = localness
    rel = dict(config.get("relative_positions") or {})
    if getattr(cfg, "relative_positions", None) is not None:
        rel["max_distance"] = cfg.relative_positions
    if getattr(cfg, "relative_positions_values", False):
        rel["values"] = True
    if getattr(cfg, "relative_positions_attention", None) is not None:
        rel["attention"] = _read_option(
            cli_types.attention_type_list,
            cfg.relative_positions_attention,
            "--relative-positions-attention",
        )
    if rel:
        config["relative_positions"] = rel
    windows = dict(config.get("dynamic_window") or {})
    if getattr(cfg, "dynamic_window_segment_size", None) is not None:
        windows["segment_size"] = cfg.dynamic_window_segment_size
    if getattr(cfg, "dynamic_window", None) is not None:
        layers = dict(windows.get("layers") or {})
        for attn_type, rest in _read_option(cli_types.dynamic_windows, cfg.dynamic_window).items():
            if rest == "none":
                layers.pop(attn_type, None)
            else:
                layers[attn_type] = rest
        windows["layers"] = layers
    if windows:
        config["dynamic_window"] = windows
    gates = dict(config.get("head_gates") or {})
    if getattr(cfg, "head_gates", None) is not None:
        given = _read_option(cli_types.attention_type_list, cfg.head_gates, "--head-gates")
        gates["attention"] = [] if given == ["none"] else given
    if getattr(cfg, "head_gate_temperature", None) is not None:
        gates["temperature"] = cfg.head_gate_temperature
    if getattr(cfg, "head_gate_log_alpha_init", None) is not None:
        gates["log_alpha_init"] = cfg.head_gate_log_alpha_init
    if getattr(cfg, "head_gate_init", None) is not None:
        gates["init"] = cfg.head_gate_init
    if gates:
        config["head_gates"] = gates
    if getattr(cfg, "heads_kept", None):
        config["heads_kept"] = load_spec_config(cfg.heads_kept)
    return config


def _read_option(read, value, *option):
    """``read(value, *option)`` of a cli_types reader, its ValueError as a LocalitySpecError."""
    try:
        return read(value, *option)
    except ValueError as error:
        raise LocalitySpecError(str(error)) from None


# Options that earlier versions stored as "" when given empty, and read as not given (no layers,
# no gates, the default attention types): a new command line refuses "", a checkpoint holding
# it is read as that version read it.
EMPTY_MEANS_UNSET = tuple(option.replace("-", "_") for option in cli_types.SELECTING_OPTIONS)
_read_as_unset_said = set()  # (checkpoint, setting): each warning once per process


def read_stored_empty_options(model_args, checkpoint, given=()) -> None:
    """Make the stored arguments of a plugin model in ``checkpoint`` build what the version that
    wrote them built: an option of EMPTY_MEANS_UNSET holding "" becomes None, and a stored
    spec's ``head_gates: {attention: ""}`` becomes [] (no gates), each said in one warning.
    Options in ``given`` (set anew at load time, e.g. --model-overrides) are left to be checked
    as any new value is."""
    model_cls = ARCH_MODEL_REGISTRY.get(_stored(model_args, "arch"))
    if model_cls is None or not model_cls.__module__.startswith(__package__):
        return
    for option in EMPTY_MEANS_UNSET:
        if option not in given and _stored(model_args, option) == "":
            _store(model_args, option, None)
            setting = f"--{option.replace('_', '-')} ''"
            _say_read_as_unset(checkpoint, setting, "the option not given")
    spec = _stored(model_args, "locality_config")
    if "locality_config" in given or not isinstance(spec, str) or not spec.startswith("{"):
        return
    try:
        config = json.loads(spec)
    except ValueError:
        return  # an inline YAML spec, refused or read where the model is built
    gates = config.get("head_gates") if isinstance(config, dict) else None
    if isinstance(gates, dict) and gates.get("attention") == "":
        gates["attention"] = []
        _store(model_args, "locality_config", json.dumps(config, sort_keys=True))
        _say_read_as_unset(checkpoint, "spec's head_gates attention ''", "[], no gates")


def _stored(model_args, name):
    if isinstance(model_args, dict):
        return model_args.get(name)
    return getattr(model_args, name, None)


def _store(model_args, name, value):
    if isinstance(model_args, dict):
        model_args[name] = value
    else:
        setattr(model_args, name, value)


def _say_read_as_unset(checkpoint, setting, reading):
    said = (os.path.abspath(str(checkpoint)), setting)  # the trainer names a file its own way
    if said not in _read_as_unset_said:
        _read_as_unset_said.add(said)
        logger.warning(
            f"{checkpoint}: the stored {setting} (an earlier version's empty value) is read as "
            f"none ({reading}), as that version read it; a new command line refuses ''"
        )


def add_locality_args(parser):
    """The options of every plugin model: the locality spec and its command-line shortcuts."""
    parser.add_argument(
        "--locality-config",
        type=str,
        metavar="NAME_OR_PATH",
        help="locality spec: a preset ("
        + ", ".join(preset_names())
        + "), a YAML file, or an inline YAML mapping such as "
        '"{encoder_self: {all: [band-1, band-2, global, ...]}}"',
    )
    parser.add_argument(
        "--localness-layers",
        type=str,
        metavar="TYPE:LAYERS ...",
        help="give every head of these layers Yang et al.'s Gaussian localness bias, e.g. "
        "'encoder_self:0-2 decoder_cross:all' (types: encoder_self, decoder_self, decoder_cross)",
    )
    parser.add_argument(
        "--localness-window",
        choices=WINDOW_STRATEGIES,
        help="how Gaussian heads choose their window (Yang et al. Sec. 3.3; default query)",
    )
    parser.add_argument(
        "--localness-fixed-window",
        type=float,
        metavar="D",
        help="window of the 'fixed' strategy (default 10)",
    )
    parser.add_argument(
        "--localness-max-window",
        type=float,
        metavar="N",
        help="largest window of the 'head' strategy, D = N sigmoid(z) (default 50)",
    )
    parser.add_argument(
        "--localness-centre",
        choices=CENTRE_CONVENTIONS,
        help="Gaussian centre and window: 'paper' (default), Yang et al.'s Eqs. 6-9, "
        "P = I sigmoid(p), D = I sigmoid(z); 'code', their released code, P = (I - 1) sigmoid(p) "
        "(never past the last real token), D = I sigmoid(z) + 0.1",
    )
    parser.add_argument(
        "--relative-positions",
        type=int,
        metavar="K",
        help="Shaw et al. relative position representations clipped at distance K",
    )
    parser.add_argument(
        "--relative-positions-values",
        action="store_true",
        help="also add relative position representations to the values",
    )
    parser.add_argument(
        "--relative-positions-attention",
        type=str,
        metavar="TYPES",
        help="comma-separated self-attention types with relative positions "
        "(default encoder_self,decoder_self)",
    )
    parser.add_argument(
        "--dynamic-window",
        type=str,
        metavar="TYPE:METHOD:LAYERS ...",
        help="Nguyen et al.'s dynamic windows on every head of these layers, e.g. "
        "'encoder_self:aw:0-2 decoder_cross:aw-seg:0-2 decoder_self:mw:0-2' (METHOD: mw, aw, "
        "mw-seg, aw-seg; -seg masks by segments of --dynamic-window-segment-size keys)",
    )
    parser.add_argument(
        "--dynamic-window-segment-size",
        type=int,
        metavar="B",
        help="segment size b of segment-based windows (default 5)",
    )
    parser.add_argument(
        "--head-gates",
        type=str,
        metavar="TYPES",
        help="Hard Concrete gates on the heads of these attention types, for L0 pruning "
        "(Voita et al. 2019): comma-separated enc, dec, cross (or none); train with "
        "--criterion label_smoothed_cross_entropy_l0",
    )
    parser.add_argument(
        "--head-gate-temperature",
        type=float,
        metavar="BETA",
        help="Hard Concrete temperature (default 2/3; Voita et al.'s code used 0.33)",
    )
    parser.add_argument(
        "--head-gate-log-alpha-init",
        type=float,
        metavar="A",
        help="initial log alpha of every gate under --head-gate-init constant (default 3: "
        "P(gate = 0) about 0.01)",
    )
    parser.add_argument(
        "--head-gate-init",
        choices=head_gates.GATE_INITS,
        help="initial log alpha: 'constant' (default, --head-gate-log-alpha-init) or 'glorot', "
        "U(-b, b) with b = sqrt(3 / heads) as in Voita et al.'s code (P(gate = 0) about 0.3 at "
        "--head-gate-temperature 0.33)",
    )
    parser.add_argument(
        "--heads-kept",
        type=str,
        metavar="YAML",
        help="heads each layer keeps, per attention type, e.g. "
        "'{encoder_self: [2, 2, 1, 0, 3, 4]}' (counts) or lists of head indices; written "
        "by scripts/prune_heads.py, or given to train a pruned shape from scratch",
    )


def first_layers(n, num_layers):
    """Selector of the first n layers, or of all of them in a shallower model."""
    return f"0-{min(n, num_layers) - 1}"


def default_dynamic_window(args, layout: dict):
    """An arch's default windows, {attention type: "METHOD:LAYERS"}, for the attention types that
    neither --dynamic-window nor the spec of --locality-config sets ("TYPE:none" turns one off)."""
    given = getattr(args, "dynamic_window", None)
    if given is not None and not given.split():
        return  # selects nothing: refused when the spec is built, not filled with the defaults
    given = given or ""
    named = {entry.partition(":")[0] for entry in given.split()}
    config = load_spec_config(getattr(args, "locality_config", None))
    named |= set((config.get("dynamic_window") or {}).get("layers") or {})
    defaults = [f"{t}:{v}" for t, v in layout.items() if t not in named]
    args.dynamic_window = " ".join([given, *defaults]).strip() or None


class HeadGateQueries:
    """Mixed into every plugin model: what the L0 criterion asks (Voita et al.)."""

    def head_gate_penalty(self, scale=head_gates.DEFAULT_L0_PENALTY_SCALE):
        """The L0 relaxation L_C over the model's head gates, summed or averaged per gated
        attention module (``scale``: sum or per-layer-mean)."""
        return head_gates.l0_penalty(self, scale)

    def open_heads(self):
        """{attention type: {layer: open heads}} under the test-time gates."""
        return head_gates.open_heads(self)
