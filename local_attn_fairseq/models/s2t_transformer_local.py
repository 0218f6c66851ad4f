"""``--arch s2t_transformer_local``: fairseq's speech-to-text Transformer with local encoder
self-attention (Alastruey et al. 2022, "On the Locality of Attention in Direct Speech
Translation").

Everything is fairseq's ``s2t_transformer`` (two strided Conv1d layers, pre-LN encoder and
decoder) except the encoder self-attention, where layer l attends to a window of
``--encoder-attention-windows`` entry w_l frames centred on each frame: (w_l - 1) / 2 on either
side, softmax renormalised inside the window (the locality spec's ``local-k`` mask with
k = (w_l - 1) / 2 on every head). 0 keeps a layer global. Windows count encoder frames after the
convolutional subsampler, i.e. 40 ms each for 10 ms fbank frames (the subsampler divides the
length by 4).

``--local-attention-form banded`` (default) runs local layers through the banded operator, with
no T x T matrix; ``masked`` masks the logits of the full T x T product instead. Both give the
same outputs and gradients.

The windows are stored in the checkpoint's arguments, so fairseq-generate and
``--load-pretrained-encoder-from`` (ASR pre-training -> ST) need nothing else; encoder parameter
names are those of ``s2t_transformer``, so either architecture's encoder initialises the other.
An ASR model trained with fairseq's CTC loss (``--criterion label_smoothed_cross_entropy_with_ctc
--ctc-weight W``) carries a CTC projection onto its own vocabulary in its encoder; the encoder
it initialises takes everything but that projection.
"""

import logging
import os
from typing import List

from fairseq.models import register_model, register_model_architecture
from fairseq.models.speech_to_text.s2t_transformer import (
    S2TTransformerEncoder,
    S2TTransformerModel,
    s2t_transformer_m,
    s2t_transformer_s,
)
from fairseq.models.transformer import TransformerConfig
from fairseq import checkpoint_utils
from torch import nn

from ..locality.spec import LocalitySpec
from ..modules.transformer_layers import LocalTransformerEncoderLayer, local_attention
from .precision_check import check_training_precision
from .resume_check import use_stored_options_on_resume

logger = logging.getLogger(__name__)

WINDOWS_OPTION = "--encoder-attention-windows"
ATTENTION_FORMS = ("banded", "masked")
# Table 1 of the paper (En-De, chosen from the contributions of the ASR/ST models): the first
# three layers global, then the windows Algorithm 1 gives.
PAPER_WINDOWS = "0,0,0,5,5,9,13,11,15,19,17,21"
# Default windows by encoder depth; the 6-layer entry keeps the paper's shape (global first
# layers, windows growing with depth) for the tiny CPU model.
DEFAULT_WINDOWS = {12: PAPER_WINDOWS, 6: "0,0,3,5,5,7"}


def parse_windows(value, num_layers: int) -> List[int]:
    """One odd window per encoder layer (0 = global) from a comma-separated string."""
    where = f"{WINDOWS_OPTION} {value!r}"
    try:
        windows = [int(w) for w in str(value).split(",")]
    except ValueError:
        raise ValueError(
            f"{where}: expected comma-separated integers, one window per encoder layer "
            f"(0 = global), e.g. {PAPER_WINDOWS!r}"
        ) from None
    if len(windows) != num_layers:
        raise ValueError(
            f"{where}: gives {len(windows)} windows but the encoder has {num_layers} layers"
        )
    for layer, w in enumerate(windows):
        if w < 0 or (w > 0 and w % 2 == 0):
            raise ValueError(
                f"{where}: layer {layer} has window {w}; a window must be odd (centred on the "
                "frame: (w - 1) / 2 frames on each side) or 0 (global attention)"
            )
    return windows


def windows_spec(windows: List[int], num_heads: int) -> LocalitySpec:
    """The locality spec of the encoder: ``local-k``, k = (w - 1) / 2, on every head of a
    windowed layer."""
    layers = {str(layer): [f"local-{(w - 1) // 2}"] * num_heads for layer, w in enumerate(windows)}
    config = {"encoder_self": {sel: heads for sel, heads in layers.items() if windows[int(sel)]}}
    return LocalitySpec(config, {"encoder_self": len(windows)}, {"encoder_self": num_heads})


class WindowedEncoderLayer(LocalTransformerEncoderLayer):
    def __init__(self, cfg, locality: LocalitySpec, layer_index: int, banded_kernel: bool):
        self.banded_kernel = banded_kernel
        super().__init__(cfg, locality, layer_index)

    def build_self_attention(self, embed_dim, cfg):
        return local_attention(
            cfg,
            self.locality,
            "encoder_self",
            self.layer_index,
            self_attention=True,
            banded_kernel=self.banded_kernel,
        )


class S2TTransformerLocalEncoder(S2TTransformerEncoder):
    """fairseq's S2T encoder (subsampler, positions, pre-LN layers) with windowed layers."""

    def __init__(self, args):
        super().__init__(args)
        self.attention_windows = parse_windows(args.encoder_attention_windows, args.encoder_layers)
        locality = windows_spec(self.attention_windows, args.encoder_attention_heads)
        cfg = TransformerConfig.from_namespace(args)
        banded = args.local_attention_form == "banded"
        # fairseq's encoder builds its layers inline; replace them (same parameter names).
        self.transformer_layers = nn.ModuleList(
            WindowedEncoderLayer(cfg, locality, layer, banded)
            for layer in range(args.encoder_layers)
        )


@register_model("s2t_transformer_local")
class S2TTransformerLocalModel(S2TTransformerModel):
    """S2T Transformer whose encoder layers attend to fixed windows (Alastruey et al. 2022)."""

    @staticmethod
    def add_args(parser):
        S2TTransformerModel.add_args(parser)
        parser.add_argument(
            WINDOWS_OPTION,
            type=str,
            metavar="W1,W2,...",
            help="one odd window per encoder layer (0 = global attention), counted in encoder "
            "frames after the x4 convolutional subsampler: layer l attends to (w - 1) / 2 "
            f"frames on each side (default for 12 layers: the paper's {PAPER_WINDOWS})",
        )
        parser.add_argument(
            "--local-attention-form",
            choices=ATTENTION_FORMS,
            help="banded: the banded operator, no T x T matrix (default); masked: mask the "
            "logits of the full product (same outputs, O(T^2) memory)",
        )
        # fairseq's decoder reads it, but S2TTransformerModel does not register it (its encoder
        # has no LayerDrop)
        parser.add_argument(
            "--decoder-layerdrop",
            type=float,
            metavar="D",
            help="LayerDrop probability of the decoder layers (Fan et al. 2019; default 0)",
        )

    @classmethod
    def build_model(cls, args, task):
        check_training_precision(args)
        use_stored_options_on_resume(cls, args)
        check_local_options(args)
        model = super().build_model(args, task)
        windows = ",".join(map(str, model.encoder.attention_windows))
        logger.info(f"encoder attention windows: {windows} ({args.local_attention_form})")
        # The encoder weights now belong to the checkpoint being trained: rebuilding this model
        # later (fairseq-generate, resuming) must not need the pretrained file any more.
        args.load_pretrained_encoder_from = None
        return model

    @classmethod
    def build_encoder(cls, args):
        encoder = S2TTransformerLocalEncoder(args)
        pretrained = getattr(args, "load_pretrained_encoder_from", None)
        if pretrained:
            load_pretrained_encoder(encoder, pretrained)
            logger.info(f"loaded pretrained encoder from {pretrained}")
        return encoder


CTC_PROJECTION = "ctc_proj."


def load_pretrained_encoder(encoder: nn.Module, checkpoint: str) -> None:
    """Copies the encoder of ``checkpoint`` into ``encoder``, every parameter but the CTC
    projection: it maps onto the pre-training task's vocabulary, so a new task keeps its own
    (or has none). Anything else missing or left over is an error naming the keys."""
    if not os.path.isfile(checkpoint):
        raise FileNotFoundError(f"--load-pretrained-encoder-from {checkpoint}: no file")
    model_state = checkpoint_utils.load_checkpoint_to_cpu(checkpoint)["model"]
    own = encoder.state_dict()
    state = {
        name[len("encoder.") :]: value
        for name, value in model_state.items()
        if name.startswith("encoder.") and not name.startswith("encoder." + CTC_PROJECTION)
    }
    state.update((name, value) for name, value in own.items() if name.startswith(CTC_PROJECTION))
    problems = [
        f"{len(names)} {kind} ({', '.join(names[:2])}{', ...' if len(names) > 2 else ''})"
        for kind, names in (
            ("missing", sorted(own.keys() - state.keys())),
            ("unexpected", sorted(state.keys() - own.keys())),
            ("of another shape", sorted(k for k in own.keys() & state.keys()
                                        if own[k].shape != state[k].shape)),
        )
        if names
    ]  # fmt: skip
    if problems:
        raise ValueError(
            f"--load-pretrained-encoder-from {checkpoint}: its encoder's parameters do not fit "
            f"this model's: {'; '.join(problems)}"
        )
    encoder.load_state_dict(state, strict=True)


def check_local_options(args):
    """Reject bad windows or forms before any parameter is built."""
    if args.local_attention_form not in ATTENTION_FORMS:
        raise ValueError(
            f"--local-attention-form {args.local_attention_form!r}: expected banded or masked"
        )
    parse_windows(args.encoder_attention_windows, args.encoder_layers)


def _local_defaults(args):
    args.local_attention_form = getattr(args, "local_attention_form", None) or "banded"
    if getattr(args, "encoder_attention_windows", None) is None:
        default = DEFAULT_WINDOWS.get(args.encoder_layers)
        if default is None:
            raise ValueError(
                f"{WINDOWS_OPTION} has no default for {args.encoder_layers} encoder layers "
                f"(defaults exist for {sorted(DEFAULT_WINDOWS)}); give one window per layer"
            )
        args.encoder_attention_windows = default


@register_model_architecture("s2t_transformer_local", "s2t_transformer_local")
def s2t_transformer_local(args):
    """fairseq's s2t_transformer_s: 12 encoder / 6 decoder layers, d=256, 4 heads, FFN 2048."""
    s2t_transformer_s(args)
    _local_defaults(args)


@register_model_architecture("s2t_transformer_local", "s2t_transformer_local_m")
def s2t_transformer_local_m(args):
    """fairseq's s2t_transformer_m: 12 encoder / 6 decoder layers, d=512, 8 heads."""
    s2t_transformer_m(args)
    _local_defaults(args)


@register_model_architecture("s2t_transformer_local", "s2t_transformer_local_tiny")
def s2t_transformer_local_tiny(args):
    """A CPU-sized model: 6 encoder / 2 decoder layers, d=64, 4 heads, FFN 256."""
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", 64)
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", 256)
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", 4)
    args.encoder_layers = getattr(args, "encoder_layers", 6)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 4)
    args.decoder_layers = getattr(args, "decoder_layers", 2)
    args.conv_channels = getattr(args, "conv_channels", 128)
    s2t_transformer_local(args)
