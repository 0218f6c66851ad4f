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

from ..locality.spec import LocalitySpec
from ..modules.transformer_layers import LocalTransformerDecoder, LocalTransformerEncoder
from .locality_options import (
    HeadGateQueries,
    add_locality_args,
    default_dynamic_window,
    first_layers,
    locality_spec_for_attention,
    settle_spec,
)
from .precision_check import check_training_precision
from .resume_check import use_stored_options_on_resume

logger = logging.getLogger(__name__)


def locality_spec_from_cfg(cfg) -> LocalitySpec:
    """The validated spec of an encoder-decoder model (flat args or fairseq's nested config)."""

    def dim(flat, nested_group, nested_key):
        if hasattr(cfg, flat):
            return getattr(cfg, flat)
        return getattr(getattr(cfg, nested_group), nested_key)

    enc_layers, dec_layers = dim("encoder_layers", "encoder", "layers"), dim(
        "decoder_layers", "decoder", "layers"
    )
    enc_heads = dim("encoder_attention_heads", "encoder", "attention_heads")
    dec_heads = dim("decoder_attention_heads", "decoder", "attention_heads")
    num_layers = {"encoder_self": enc_layers, "decoder_self": dec_layers}
    num_heads = {"encoder_self": enc_heads, "decoder_self": dec_heads}
    name = "a Transformer"
    if has_cross_attention(cfg):
        num_layers["decoder_cross"], num_heads["decoder_cross"] = dec_layers, dec_heads
    else:  # settings for cross-attention would be silently unused: refused instead
        name += " without cross-attention (--no-cross-attention)"
    return locality_spec_for_attention(cfg, num_layers, num_heads, name)


def has_cross_attention(cfg) -> bool:
    return not getattr(cfg, "no_cross_attention", False)


@register_model("transformer_local")
class LocalTransformerModel(HeadGateQueries, TransformerModel):
    """Transformer whose attention heads follow a locality spec (Pande et al. and later papers).

    Without ``--locality-config`` every head is global: the plain Transformer.
    """

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        add_locality_args(parser)
        parser.add_argument(
            "--freeze-decoder",
            action="store_true",
            help="train only the encoder and the head gates (pruning encoder heads, Voita et "
            "al. 6.2): decoder parameters not shared with the encoder stay fixed",
        )
        parser.add_argument(
            "--load-pretrained-encoder-from",
            type=str,
            metavar="CHECKPOINT",
            help="initialise the encoder from the encoder of this checkpoint (same shape)",
        )

    @classmethod
    def build_model(cls, args, task):
        check_training_precision(args)
        use_stored_options_on_resume(cls, args)
        base_architecture(args)
        settle_spec(args, locality_spec_from_cfg(args))
        model = super().build_model(args, task)
        # The encoder weights now come from the checkpoint being trained; rebuilding this model
        # later (fairseq-generate, resuming) must not need the pretrained file any more.
        args.load_pretrained_encoder_from = None
        if getattr(args, "freeze_decoder", False):
            freeze_decoder(model)
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


def freeze_decoder(model):
    """Fix the decoder's parameters except its head gates and what it shares with the encoder."""
    encoder_params = {id(p) for p in model.encoder.parameters()}
    frozen = 0
    for name, param in model.decoder.named_parameters():
        if "head_gates" in name or id(param) in encoder_params:
            continue
        param.requires_grad_(False)
        frozen += param.numel()
    logger.info(f"--freeze-decoder: {frozen:,} decoder parameters are fixed")


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
    # an empty --localness-layers is refused when the spec is built, not replaced by the default
    if getattr(args, "localness_layers", None) is None:
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


@register_model_architecture("transformer_local", "transformer_dynwin")
def transformer_dynwin(args):
    """Nguyen et al.'s best MT model, Enc(AW) - Cr(AW, Seg) - Dec(MW) in the first 3 layers;
    --dynamic-window changes the layout of the attention types it names."""
    transformer_local_base(args)
    enc, dec = first_layers(3, args.encoder_layers), first_layers(3, args.decoder_layers)
    layout = {
        "encoder_self": f"aw:{enc}",
        "decoder_cross": f"aw-seg:{dec}",
        "decoder_self": f"mw:{dec}",
    }
    if not has_cross_attention(args):  # --no-cross-attention: Enc(AW) - Dec(MW)
        del layout["decoder_cross"]
    default_dynamic_window(args, layout)


@register_model_architecture("transformer_local", "transformer_dynwin_iwslt_de_en")
def transformer_dynwin_iwslt_de_en(args):
    transformer_local_iwslt_de_en(args)
    transformer_dynwin(args)


@register_model_architecture("transformer_local", "transformer_dynwin_tiny")
def transformer_dynwin_tiny(args):
    tiny_dims(args)
    transformer_dynwin(args)
