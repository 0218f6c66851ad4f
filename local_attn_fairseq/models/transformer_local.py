"""``--arch transformer_local`` and its presets: fairseq's Transformer with a locality spec.

``--locality-config`` takes a preset name (``configs/locality/*.yaml``), a YAML file, or an
inline YAML mapping. The spec is validated against the model's layer and head counts before any
parameter is built, and its canonical JSON replaces the option's value in the saved arguments,
so a checkpoint describes itself and fairseq-generate rebuilds the same model without the file.
"""

import logging

from fairseq import checkpoint_utils
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerModel, base_architecture
from fairseq.models.transformer.transformer_legacy import transformer_iwslt_de_en

from ..locality.gaussian import WINDOW_STRATEGIES
from ..locality.spec import LocalitySpec, LocalitySpecError, load_spec_config, preset_names
from ..modules.transformer_layers import LocalTransformerDecoder, LocalTransformerEncoder

logger = logging.getLogger(__name__)


def locality_spec_from_cfg(cfg) -> LocalitySpec:
    """Build and validate the spec named by ``cfg.locality_config`` for this model's shape."""

    def dim(flat, nested_group, nested_key):
        if hasattr(cfg, flat):
            return getattr(cfg, flat)
        return getattr(getattr(cfg, nested_group), nested_key)

    num_layers = {
        "encoder_self": dim("encoder_layers", "encoder", "layers"),
        "decoder_self": dim("decoder_layers", "decoder", "layers"),
        "decoder_cross": dim("decoder_layers", "decoder", "layers"),
    }
    num_heads = {
        "encoder_self": dim("encoder_attention_heads", "encoder", "attention_heads"),
        "decoder_self": dim("decoder_attention_heads", "decoder", "attention_heads"),
        "decoder_cross": dim("decoder_attention_heads", "decoder", "attention_heads"),
    }
    try:
        config = load_spec_config(getattr(cfg, "locality_config", None))
        return LocalitySpec(with_command_line_settings(config, cfg), num_layers, num_heads)
    except LocalitySpecError as e:
        raise LocalitySpecError(
            f"invalid locality spec (--locality-config, --localness-*, --relative-positions*): {e}"
        ) from None


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
    ):
        if getattr(cfg, option, None) is not None:
            localness[key] = getattr(cfg, option)
    if getattr(cfg, "localness_layers", None):
        layers = dict(localness.get("layers") or {})
        for entry in cfg.localness_layers.split():
            attn_type, sep, selector = entry.partition(":")
            if not sep:
                raise LocalitySpecError(
                    f"--localness-layers entry {entry!r} is not ATTENTION_TYPE:LAYERS "
                    "(e.g. encoder_self:0-2)"
                )
            layers[attn_type] = selector
        localness["layers"] = layers
    if localness:
        config["localness"] = localness
    rel = dict(config.get("relative_positions") or {})
    if getattr(cfg, "relative_positions", None) is not None:
        rel["max_distance"] = cfg.relative_positions
    if getattr(cfg, "relative_positions_values", False):
        rel["values"] = True
    if getattr(cfg, "relative_positions_attention", None):
        rel["attention"] = cfg.relative_positions_attention.split(",")
    if rel:
        config["relative_positions"] = rel
    return config


@register_model("transformer_local")
class LocalTransformerModel(TransformerModel):
    """Transformer whose attention heads follow a locality spec (Pande et al. and later papers).

    Without ``--locality-config`` every head is global: the plain Transformer.
    """

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
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
            "--load-pretrained-encoder-from",
            type=str,
            metavar="CHECKPOINT",
            help="initialise the encoder from the encoder of this checkpoint (same shape)",
        )

    @classmethod
    def build_model(cls, args, task):
        base_architecture(args)
        spec = locality_spec_from_cfg(args)
        args.locality_config = spec.to_json()
        logger.info(spec.describe())
        model = super().build_model(args, task)
        # The encoder weights now come from the checkpoint being trained; rebuilding this model
        # later (fairseq-generate, resuming) must not need the pretrained file any more.
        args.load_pretrained_encoder_from = None
        return model

    @classmethod
    def build_encoder(cls, cfg, src_dict, embed_tokens):
        encoder = LocalTransformerEncoder(cfg, src_dict, embed_tokens, locality_spec_from_cfg(cfg))
        pretrained = getattr(cfg, "load_pretrained_encoder_from", None)
        if pretrained:
            encoder = checkpoint_utils.load_pretrained_component_from_model(encoder, pretrained)
            logger.info(f"loaded pretrained encoder from {pretrained}")
        return encoder

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens):
        return LocalTransformerDecoder(
            cfg,
            tgt_dict,
            embed_tokens,
            locality_spec_from_cfg(cfg),
            no_encoder_attn=cfg.no_cross_attention,
        )


def _default_locality(args, preset):
    if not getattr(args, "locality_config", None):
        args.locality_config = preset


@register_model_architecture("transformer_local", "transformer_local")
def transformer_local_base(args):
    args.locality_config = getattr(args, "locality_config", None)
    base_architecture(args)


@register_model_architecture("transformer_local", "transformer_local_tied")
def transformer_local_tied(args):
    """Pande et al. config (i), 1LocHead 7TiedLoc All6: the paper's recommended trade-off."""
    _default_locality(args, "1loc7tied-all6")
    transformer_local_base(args)


def tiny_dims(args):
    """8 heads and 6 layers (what the paper's presets assume) at a size trainable on a CPU."""
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", 256)
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", 512)
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", 8)
    args.encoder_layers = getattr(args, "encoder_layers", 6)
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", 256)
    args.decoder_ffn_embed_dim = getattr(args, "decoder_ffn_embed_dim", 512)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 8)
    args.decoder_layers = getattr(args, "decoder_layers", 3)


@register_model_architecture("transformer_local", "transformer_local_tiny")
def transformer_local_tiny(args):
    tiny_dims(args)
    transformer_local_base(args)


@register_model_architecture("transformer_local", "transformer_local_tied_tiny")
def transformer_local_tied_tiny(args):
    tiny_dims(args)
    transformer_local_tied(args)


@register_model_architecture("transformer_local", "transformer_local_iwslt_de_en")
def transformer_local_iwslt_de_en(args):
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", 8)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 8)
    transformer_iwslt_de_en(args)
    transformer_local_base(args)


@register_model_architecture("transformer_local", "transformer_local_tied_iwslt_de_en")
def transformer_local_tied_iwslt_de_en(args):
    _default_locality(args, "1loc7tied-all6")
    transformer_local_iwslt_de_en(args)


@register_model_architecture("transformer_local", "transformer_localness")
def transformer_localness(args):
    """Yang et al.'s default: query-specific windows in encoder layers 1-3 (0-2 here)."""
    if not getattr(args, "localness_layers", None):
        args.localness_layers = "encoder_self:0-2"
    transformer_local_base(args)


@register_model_architecture("transformer_local", "transformer_localness_big")
def transformer_localness_big(args):
    from fairseq.models.transformer.transformer_legacy import transformer_vaswani_wmt_en_de_big

    transformer_vaswani_wmt_en_de_big(args)
    transformer_localness(args)


@register_model_architecture("transformer_local", "transformer_localness_tiny")
def transformer_localness_tiny(args):
    tiny_dims(args)
    transformer_localness(args)


@register_model_architecture("transformer_local", "transformer_local_tied_big")
def transformer_local_tied_big(args):
    from fairseq.models.transformer.transformer_legacy import transformer_vaswani_wmt_en_de_big

    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", 8)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 8)
    _default_locality(args, "1loc7tied-all6")
    transformer_vaswani_wmt_en_de_big(args)
    transformer_local_base(args)
