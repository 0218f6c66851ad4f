"""``--arch roberta_local`` and ``roberta_dynwin_classifier``: a RoBERTa-style encoder whose
self-attention follows a locality spec, for fairseq's ``sentence_prediction`` task (Nguyen et al.
2020, Table 5: sentiment and subject-verb agreement classification).

fairseq's ``RobertaEncoder`` builds its Transformer stack in ``build_encoder``; overriding that
one method puts ``LocalTransformerEncoder`` in its place, and everything else (embeddings, LM
head, classification heads, BERT initialisation, checkpoint upgrades) stays fairseq's. Only
``encoder_self`` exists: settings for decoder attention are rejected before training. The
validated spec replaces ``--locality-config`` in the saved arguments, so a checkpoint describes
itself.
"""

from fairseq.models import register_model, register_model_architecture
from fairseq.models.roberta.model import RobertaEncoder, RobertaModel
from fairseq.models.roberta.model import base_architecture as roberta_base_architecture
from fairseq.models.transformer import TransformerConfig
from fairseq.modules.transformer_sentence_encoder import init_bert_params
from fairseq.utils import safe_hasattr

from ..locality.spec import LocalitySpec
from ..modules.transformer_layers import LocalTransformerEncoder
from .locality_options import (
    HeadGateQueries,
    add_locality_args,
    default_dynamic_window,
    locality_spec_for_attention,
    settle_spec,
)
from .precision_check import check_training_precision
from .resume_check import use_stored_options_on_resume


def encoder_locality_spec(args) -> LocalitySpec:
    return locality_spec_for_attention(
        args,
        {"encoder_self": args.encoder_layers},
        {"encoder_self": args.encoder_attention_heads},
        "a RoBERTa-style encoder",
    )


class LocalRobertaEncoder(RobertaEncoder):
    """RoBERTa's encoder with the plugin's Transformer stack inside."""

    def __init__(self, args, dictionary, locality: LocalitySpec):
        self.locality = locality  # read by build_encoder, which RobertaEncoder.__init__ calls
        super().__init__(args, dictionary)

    def build_encoder(self, args, dictionary, embed_tokens):
        encoder = LocalTransformerEncoder(
            TransformerConfig.from_namespace(args), dictionary, embed_tokens, self.locality
        )
        encoder.apply(init_bert_params)
        return encoder


@register_model("roberta_local")
class LocalRobertaModel(HeadGateQueries, RobertaModel):
    """RoBERTa whose encoder heads follow a locality spec; without one, fairseq's RoBERTa."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        add_locality_args(parser)

    @classmethod
    def build_model(cls, args, task):
        check_training_precision(args)
        use_stored_options_on_resume(cls, args)
        roberta_base_architecture(args)
        spec = settle_spec(args, encoder_locality_spec(args))
        if not safe_hasattr(args, "max_positions"):
            # masked LM training names the length tokens_per_sample; sentence_prediction sets it
            args.max_positions = getattr(args, "tokens_per_sample", None) or task.max_positions()
        return cls(args, LocalRobertaEncoder(args, task.source_dictionary, spec))


@register_model_architecture("roberta_local", "roberta_local")
def roberta_local(args):
    """RoBERTa base sizes (768 dims, 12 layers, 12 heads); global heads by default."""
    args.locality_config = getattr(args, "locality_config", None)
    roberta_base_architecture(args)


@register_model_architecture("roberta_local", "roberta_local_classifier")
def roberta_local_classifier(args):
    """Nguyen et al.'s text classification encoder (tensor2tensor's tiny Transformer): 2 layers,
    4 heads, 128 dims, FFN 512; all heads global (the Vaswani et al. row of Table 5)."""
    args.encoder_layers = getattr(args, "encoder_layers", 2)
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", 4)
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", 128)
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", 512)
    roberta_local(args)


@register_model_architecture("roberta_local", "roberta_dynwin_classifier")
def roberta_dynwin_classifier(args):
    """Nguyen et al.'s Enc(MW) for classification: multiplicative windows in the first layer;
    ``--dynamic-window encoder_self:aw:0`` gives Enc(AW)."""
    default_dynamic_window(args, {"encoder_self": "mw:0"})
    roberta_local_classifier(args)


@register_model_architecture("roberta_local", "roberta_dynwin_classifier_tiny")
def roberta_dynwin_classifier_tiny(args):
    """Enc(MW) at 32 dims and FFN 64: for tests and CPU demos."""
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", 32)
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", 64)
    roberta_dynwin_classifier(args)
