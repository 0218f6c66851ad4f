"""``--arch transformer_lm_local`` and ``transformer_lm_dynwin``: fairseq's Transformer language
model whose causal self-attention follows a locality spec (Nguyen et al. 2020, Table 6).

Only ``decoder_self`` exists in a language model: a spec or an option that names
``encoder_self`` or ``decoder_cross`` is rejected before any parameter is built. The validated
spec replaces ``--locality-config`` in the saved arguments, so fairseq-eval-lm and the generator
rebuild the same model from the checkpoint alone. Train with fairseq's ``language_modeling``
task; the dynamic windows decode incrementally with the same outputs as the full forward pass.
"""

import logging

import torch
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerConfig
from fairseq.models.transformer_lm import (
    DEFAULT_MAX_TARGET_POSITIONS,
    TransformerLanguageModel,
    TransformerLanguageModelConfig,
    base_lm_architecture,
)
from fairseq.utils import safe_getattr

from ..cpu_allocator import slow_malloc_warning
from ..locality.spec import LocalitySpec
from ..modules.transformer_layers import LocalTransformerDecoder
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


def lm_locality_spec(args) -> LocalitySpec:
    return locality_spec_for_attention(
        args,
        {"decoder_self": args.decoder_layers},
        {"decoder_self": args.decoder_attention_heads},
        "a language model",
    )


@register_model("transformer_lm_local")
class LocalTransformerLanguageModel(HeadGateQueries, TransformerLanguageModel):
    """fairseq's ``transformer_lm`` whose decoder heads follow a locality spec.

    Registered without a dataclass (unlike ``transformer_lm``): its arguments stay one flat
    namespace that carries the locality options and the stored spec into the checkpoint, as
    those of ``transformer_local`` do.
    """

    @classmethod
    def add_args(cls, parser):
        gen_parser_from_dataclass(parser, TransformerLanguageModelConfig(), delete_default=True)
        add_locality_args(parser)
        parser.add_argument(
            "--decoder-post-norm",
            action="store_true",
            help="layer norm after each sub-layer, as in Vaswani et al.'s Transformer (these "
            "architectures take fairseq's base_lm_architecture, which sets pre-norm whatever "
            "--decoder-normalize-before says; fairseq's own transformer_lm, built from its "
            "config, is post-norm unless given --decoder-normalize-before)",
        )

    @classmethod
    def build_model(cls, args, task):
        check_training_precision(args)
        use_stored_options_on_resume(cls, args)
        base_lm_architecture(args)
        if safe_getattr(args, "decoder_post_norm", False):
            # after base_lm_architecture, which sets pre-norm unconditionally
            args.decoder_normalize_before = False
        _reject_unsupported_inputs(args)
        spec = settle_spec(args, lm_locality_spec(args))
        if safe_getattr(args, "max_target_positions", None) is None:
            args.max_target_positions = safe_getattr(
                args, "tokens_per_sample", DEFAULT_MAX_TARGET_POSITIONS
            )
        if safe_getattr(args, "cpu", False) or not torch.cuda.is_available():
            tokens = safe_getattr(args, "tokens_per_sample", 0) or 0
            warning = slow_malloc_warning(tokens, args.decoder_embed_dim)
            if warning:
                logger.warning(warning)
        embed_tokens = cls.build_embedding(args, task.source_dictionary, args.decoder_input_dim)
        decoder = LocalTransformerDecoder(
            TransformerConfig.from_namespace(args),
            task.target_dictionary,
            embed_tokens,
            spec,
            no_encoder_attn=True,
        )
        return cls(decoder)


def _reject_unsupported_inputs(args):
    for option in ("character_embeddings", "adaptive_input"):
        if safe_getattr(args, option, False):
            flag = "--" + option.replace("_", "-")
            raise ValueError(f"{flag} is not supported by transformer_lm_local (word embeddings)")


@register_model_architecture("transformer_lm_local", "transformer_lm_local")
def transformer_lm_local(args):
    """fairseq's LM defaults (``base_lm_architecture``, as its named LM archs use: 512 dims, FFN
    2048, 6 layers, 8 heads, pre-norm); global heads unless a spec says otherwise."""
    args.locality_config = getattr(args, "locality_config", None)
    base_lm_architecture(args)


@register_model_architecture("transformer_lm_local", "transformer_lm_dynwin")
def transformer_lm_dynwin(args):
    """Nguyen et al.'s Dec(MW): multiplicative windows in the first 3 decoder layers (Table 6);
    ``--dynamic-window decoder_self:aw:0-2`` gives Dec(AW)."""
    transformer_lm_local(args)
    default_dynamic_window(args, {"decoder_self": f"mw:{first_layers(3, args.decoder_layers)}"})


def tiny_lm_dims(args):
    """A size a CPU trains in minutes (128 dims, FFN 512, 4 heads, tied input/output
    embeddings), with the 3 layers the default windows need."""
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", 128)
    args.decoder_ffn_embed_dim = getattr(args, "decoder_ffn_embed_dim", 512)
    args.decoder_layers = getattr(args, "decoder_layers", 3)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 4)
    args.share_decoder_input_output_embed = getattr(args, "share_decoder_input_output_embed", True)


@register_model_architecture("transformer_lm_local", "transformer_lm_local_tiny")
def transformer_lm_local_tiny(args):
    tiny_lm_dims(args)
    transformer_lm_local(args)


@register_model_architecture("transformer_lm_local", "transformer_lm_dynwin_tiny")
def transformer_lm_dynwin_tiny(args):
    tiny_lm_dims(args)
    transformer_lm_dynwin(args)
