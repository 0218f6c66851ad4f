"""fairseq's Transformer encoder/decoder layers and stacks, with LocalMultiheadAttention inside.

The layers change nothing but which attention module they build; the stacks tell each layer its
index and its heads' locality, then bind the Wq/Wk that heads borrow across layers.
"""

import torch
from fairseq.models.transformer import TransformerDecoderBase, TransformerEncoderBase
from fairseq.modules.transformer_layer import (
    TransformerDecoderLayerBase,
    TransformerEncoderLayerBase,
)
from torch import nn

from ..locality.spec import LocalitySpec
from .local_multihead_attention import LocalMultiheadAttention


def refuse_foreign_attention_options(cfg):
    """Options of fairseq's MultiheadAttention that the plugin's attention cannot honour: refused
    by name rather than ignored."""
    if cfg.quant_noise.pq > 0:
        # fairseq's quant noise is a forward hook on each projection; the plugin's attention
        # reads the projection weights directly (one call for Q, K and V), so no hook would run.
        raise ValueError(
            "--quant-noise-pq: quantization noise is not supported by the plugin's attention "
            "layers (it would leave their projections without noise); leave the option out"
        )
    for side in ("encoder", "decoder"):
        if getattr(getattr(cfg, side), "xformers_att_config", None):
            raise ValueError(
                f"--{side}-xformers-att-config: the plugin's attention layers compute attention "
                "themselves (head masks, banded kernel, localness, windows, gates) and cannot run "
                "xFormers' attention; leave the option out"
            )


def local_attention(cfg, locality: LocalitySpec, attn_type: str, layer_index: int, **kwargs):
    """The attention module of one layer, configured by what the spec says of it."""
    refuse_foreign_attention_options(cfg)
    group = cfg.encoder if attn_type == "encoder_self" else cfg.decoder
    return LocalMultiheadAttention(
        group.embed_dim,
        group.attention_heads,
        dropout=cfg.attention_dropout,
        head_specs=locality.heads(attn_type, layer_index),
        layer_index=layer_index,
        attention_type=attn_type,
        causal=attn_type == "decoder_self",
        localness=locality.localness,
        relative_max_distance=locality.relative_max_distance(attn_type),
        relative_values=bool(locality.relative_positions["values"]),
        kept_heads=locality.kept_heads(attn_type, layer_index),
        qk_rows=locality.qk_rows(attn_type, layer_index),
        gates=locality.gate_settings(attn_type),
        **kwargs,
    )


class LocalTransformerEncoderLayer(TransformerEncoderLayerBase):
    def __init__(self, cfg, locality: LocalitySpec, layer_index: int, return_fc=False):
        self.locality, self.layer_index = locality, layer_index
        super().__init__(cfg, return_fc=return_fc)

    def build_self_attention(self, embed_dim, cfg):
        return local_attention(
            cfg, self.locality, "encoder_self", self.layer_index, self_attention=True
        )


class LocalTransformerDecoderLayer(TransformerDecoderLayerBase):
    def __init__(
        self, cfg, locality: LocalitySpec, layer_index: int, no_encoder_attn=False, **kwargs
    ):
        self.locality, self.layer_index = locality, layer_index
        super().__init__(cfg, no_encoder_attn=no_encoder_attn, **kwargs)
        if self.c_attn is not None and self.nh * self.head_dim != self.embed_dim:
            # NormFormer's head scales (--scale-heads) act on the self-attention output after
            # out_proj, in chunks of head_dim: one per head of the unpruned layer, pruned or not.
            self.nh = self.embed_dim // self.head_dim
            self.c_attn = nn.Parameter(torch.ones(self.nh))

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        if add_bias_kv or add_zero_attn:
            raise ValueError("add_bias_kv / add_zero_attn are not supported with local attention")
        positional = self.locality.is_local("decoder_self") or self.locality.relative_max_distance(
            "decoder_self"
        )
        if cfg.cross_self_attention and positional:
            raise ValueError(
                "--cross-self-attention prepends the source to the decoder keys, so positional "
                "decoder self-attention mechanisms would be misaligned; use one or the other"
            )
        return local_attention(
            cfg,
            self.locality,
            "decoder_self",
            self.layer_index,
            self_attention=not cfg.cross_self_attention,
        )

    def build_encoder_attention(self, embed_dim, cfg):
        return local_attention(
            cfg,
            self.locality,
            "decoder_cross",
            self.layer_index,
            kdim=cfg.encoder.embed_dim,
            vdim=cfg.encoder.embed_dim,
            encoder_decoder_attention=True,
        )


def _unwrap(layer):
    # fsdp_wrap / checkpoint_wrapper may wrap a layer; the attention lives on the inner module.
    return getattr(layer, "module", layer)


def bind_tied_projections(layers, attribute):
    # Index, never iterate: iterating fairseq's LayerDropModuleList in training mode (as it is
    # right after construction) skips layers at random and draws from the global RNG.
    attention = [getattr(_unwrap(layers[i]), attribute) for i in range(len(layers))]
    for module in attention:
        module.bind_qk_owners(attention)


class LocalTransformerEncoder(TransformerEncoderBase):
    def __init__(self, cfg, dictionary, embed_tokens, locality: LocalitySpec, return_fc=False):
        self.locality = locality
        self._layers_built = 0
        super().__init__(cfg, dictionary, embed_tokens, return_fc=return_fc)
        bind_tied_projections(self.layers, "self_attn")

    def build_encoder_layer(self, cfg):
        layer = LocalTransformerEncoderLayer(
            cfg, self.locality, self._layers_built, return_fc=self.return_fc
        )
        self._layers_built += 1
        return self._wrap_layer(layer, cfg)

    @staticmethod
    def _wrap_layer(layer, cfg):
        from fairseq.distributed import fsdp_wrap
        from fairseq.modules.checkpoint_activations import checkpoint_wrapper

        if cfg.checkpoint_activations:
            layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
        min_params = cfg.min_params_to_wrap if not cfg.checkpoint_activations else 0
        return fsdp_wrap(layer, min_num_params=min_params)


class LocalTransformerDecoder(TransformerDecoderBase):
    def __init__(
        self,
        cfg,
        dictionary,
        embed_tokens,
        locality: LocalitySpec,
        no_encoder_attn=False,
        output_projection=None,
    ):
        if getattr(cfg, "base_layers", 0):
            # fairseq inserts its BASE layers among the decoder's layers, which would shift the
            # layer numbers the locality spec, the Wq/Wk ties and layers_to_keep count by.
            raise ValueError(
                "--base-layers: BASE layers are not supported in the plugin's decoders (they "
                "would renumber the layers that the locality spec and Wq/Wk ties refer to); "
                "leave the option out"
            )
        self.locality = locality
        self._layers_built = 0
        super().__init__(
            cfg,
            dictionary,
            embed_tokens,
            no_encoder_attn=no_encoder_attn,
            output_projection=output_projection,
        )
        bind_tied_projections(self.layers, "self_attn")
        if not no_encoder_attn:
            bind_tied_projections(self.layers, "encoder_attn")

    def buffered_future_mask(self, tensor):
        """None: every self-attention layer of this decoder applies its own causality (the band's
        right side, SDPA's causal kernel, or a mask built for the layers that read one), so no
        (T, T) float mask is built for the whole decoder."""
        return None

    def extract_features_scriptable(
        self,
        prev_output_tokens,
        encoder_out,
        incremental_state=None,
        full_context_alignment: bool = False,
        alignment_layer=None,
        alignment_heads=None,
    ):
        if full_context_alignment:
            raise ValueError(
                "full_context_alignment: the plugin's decoder self-attention layers are causal "
                "whatever the caller's mask, so alignment over the full target context is not "
                "available; leave it off"
            )
        return super().extract_features_scriptable(
            prev_output_tokens, encoder_out, incremental_state, False, alignment_layer,
            alignment_heads,
        )  # fmt: skip

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        layer = LocalTransformerDecoderLayer(
            cfg, self.locality, self._layers_built, no_encoder_attn=no_encoder_attn
        )
        self._layers_built += 1
        return LocalTransformerEncoder._wrap_layer(layer, cfg)
