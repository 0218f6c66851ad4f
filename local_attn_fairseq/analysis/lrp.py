"""Layer-wise relevance propagation (LRP) through fairseq Transformers: how much each attention
head contributes to the model's top-1 logit (Voita et al. 2019, Section 4 and Appendix A).

    result = propagate_relevance(model, sample)
    result.heads[("encoder_self", 2)]   # (steps, bsz, heads): relevance of each head's output
    result.steps_mask                   # (steps, bsz): which target steps are real tokens
    normalised = normalise_over_heads(result.heads[key])   # what Voita et al. average

The model runs once with teacher forcing (eval mode). Every target step ``t`` starts with
relevance 1 on its top-1 logit, and that relevance travels down the real modules of the model
(fairseq's encoder/decoder layers, with ``LocalMultiheadAttention`` or fairseq's own
``MultiheadAttention``) to the encoder's first layer. All steps travel at once: relevance tensors
carry a leading ``steps`` dimension.

The rules are the weight ratios of Ding et al. (2017), as Voita et al. use them. A neuron ``v``
that sums contributions of its inputs, ``v = sum_u z_u`` with ``z_u = W_uv u``, shares its
relevance among the inputs in proportion to their contributions:

* ``rule="ratio"``: Ding's weight ratio ``z_u / sum_u' z_u'``, signed, the denominator moved
  away from 0 by ``eps``. Where positive and negative contributions nearly cancel, the shares
  explode: on a trained model (a demo model of the Ding corpus) relevance grows by orders of
  magnitude through a few layers and head relevance averages to noise, so this rule is not the
  default;
* ``rule="alpha-beta"`` (default, the rule of Voita et al.'s released implementation): the
  weight ratio applied to the positive and the negative contributions separately,
  ``alpha * z_u+ / sum z+  +  (1 - alpha) * z_u- / sum z-`` (``alpha = 0.5``; when one sign is
  absent the other takes all). Every share lies in [0, 1], so positive relevance stays
  positive and nothing explodes.

The rules apply to the model's real modules:

* linear maps (the V and output projections, the FFN, the vocabulary projection) and the
  residual sums; biases are not inputs (Ding's sums run over the inputs only);
* the attention output ``o_i = sum_j a_ij v_j``, with the weights ``a_ij`` (after the head
  masks and windows, as the module applied them) as the connection strengths: no relevance
  flows into the queries and keys, i.e. through the softmax. Relative-position value terms
  (Shaw et al.) are, like biases, not inputs;
* element-wise non-linearities (ReLU/GELU, dropout, the head gates, LayerNorm's per-token
  normalisation) are ignored as Ding et al. do: relevance passes through them unchanged.

What is conserved: the shares of every neuron sum to exactly 1 (``alpha-beta``; with
``ratio``, to ``z / (z + eps)``), so the relevance a layer receives equals, to rounding (float64),
the relevance it passes down. In the encoder, the total at a layer's output equals the total at
its input; in the decoder, the total at its input plus what its cross-attention passes to the
encoder output. Only a neuron whose every contribution is exactly 0 passes nothing on.

A head's relevance is the sum of the relevance of its output neurons (the input of W_O, after
its gate: a closed gate's head has relevance 0), normalised over the heads of the layer.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq.modules import MultiheadAttention
from torch import Tensor, nn

from .loading import ATTENTION_TYPES, attention_hooks, head_numbers

EPSILON = 1e-6
AttentionKey = Tuple[str, int]


# -- the rules ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    """How a neuron's relevance is shared among the contributions of its inputs."""

    name: str = "alpha-beta"  # or "ratio"
    alpha: float = 0.5  # alpha-beta: the part shared by the positive contributions
    eps: float = EPSILON  # ratio: the stabiliser of the denominators

    def __post_init__(self):
        if self.name not in RULES:
            raise ValueError(f"unknown LRP rule {self.name!r}; expected one of {', '.join(RULES)}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"LRP alpha must lie in [0, 1], got {self.alpha}")

    def scales(self, relevance: Tensor, positive: Tensor, negative: Tensor):
        """Relevance per unit of positive and of negative contribution, given each neuron's
        sums of positive and negative contributions."""
        if self.name == "ratio":
            scale = relevance / stabilise(positive + negative, self.eps)
            return scale, scale
        has_positive, has_negative = positive > 0, negative < 0
        alpha = torch.where(has_negative, self.alpha, 1.0) * has_positive
        beta = torch.where(has_positive, 1.0 - alpha, 1.0) * has_negative
        one = torch.ones_like(positive)
        return (
            relevance * alpha / torch.where(has_positive, positive, one),
            relevance * beta / torch.where(has_negative, negative, one),
        )


RULES = ("alpha-beta", "ratio")


def stabilise(z: Tensor, eps: float = EPSILON) -> Tensor:
    """Denominators pushed away from 0 (0 counts as positive, so it never divides)."""
    return z + eps * torch.where(z >= 0, 1.0, -1.0).to(z.dtype)


def _signs(x: Tensor) -> Tuple[Tensor, Tensor]:
    return x.clamp(min=0), x.clamp(max=0)


def relprop_linear(inputs: Tensor, weight: Tensor, relevance: Tensor, rule=Rule()) -> Tensor:
    """``y = inputs @ weight.T (+ bias)``: each output's relevance shared among the
    contributions ``x_i W_ji``. inputs (..., in), relevance (steps, ..., out)."""
    x_pos, x_neg = _signs(inputs)
    w_pos, w_neg = _signs(weight.to(inputs.dtype))
    # sums of the positive and negative contributions x_i W_ji, without the (..., out, in) tensor
    positive = x_pos @ w_pos.t() + x_neg @ w_neg.t()
    negative = x_pos @ w_neg.t() + x_neg @ w_pos.t()
    s_pos, s_neg = rule.scales(relevance, positive, negative)
    return x_pos * (s_pos @ w_pos + s_neg @ w_neg) + x_neg * (s_pos @ w_neg + s_neg @ w_pos)


def relprop_sum(parts: List[Tensor], relevance: Tensor, rule=Rule()) -> List[Tensor]:
    """``y = sum(parts)`` (a residual connection): shares in proportion to each part."""
    signed = [_signs(part) for part in parts]
    s_pos, s_neg = rule.scales(
        relevance, sum(pos for pos, _ in signed), sum(neg for _, neg in signed)
    )
    return [pos * s_pos + neg * s_neg for pos, neg in signed]


def relprop_attention(weights: Tensor, values: Tensor, relevance: Tensor, rule=Rule()) -> Tensor:
    """``o_i = sum_j a_ij v_j`` per head, the weights (>= 0) as connection strengths.

    weights (bsz, heads, tgt, src), values (bsz, heads, src, dim),
    relevance (steps, bsz, heads, tgt, dim) -> the values' relevance (steps, bsz, heads, src, dim).
    """
    v_pos, v_neg = _signs(values)
    s_pos, s_neg = rule.scales(relevance, weights @ v_pos, weights @ v_neg)

    def back(scale):
        return torch.einsum("sbhid,bhij->sbhjd", scale, weights)

    return v_pos * back(s_pos) + v_neg * back(s_neg)


def normalise_over_heads(relevance: Tensor) -> Tensor:
    """Head relevance (..., heads) divided by the layer's total absolute relevance, so that the
    heads' shares of a prediction have absolute values summing to 1 (a step where no relevance
    reached the layer stays 0)."""
    total = relevance.abs().sum(-1, keepdim=True)
    return relevance / torch.where(total > 0, total, torch.ones_like(total))


# -- recording one forward pass --------------------------------------------------------------
@dataclass
class AttentionRecord:
    value_input: Tensor  # (src_len, bsz, dim): what the V projection read
    weights: Tensor  # (bsz, heads, tgt_len, src_len), after masks, windows and padding
    head_outputs: Tensor  # (tgt_len, bsz, heads * head_dim): the input of W_O, after the gates
    output: Tensor  # (tgt_len, bsz, dim): after W_O


@dataclass
class ForwardRecord:
    attention: Dict[AttentionKey, AttentionRecord] = field(default_factory=dict)
    layer_inputs: Dict[Tuple[str, int], Tensor] = field(default_factory=dict)
    linear_inputs: Dict[nn.Module, Tensor] = field(default_factory=dict)
    linear_outputs: Dict[nn.Module, Tensor] = field(default_factory=dict)

    def to(self, dtype) -> "ForwardRecord":
        def convert(t):
            return None if t is None else t.detach().to(dtype)

        return ForwardRecord(
            {
                key: AttentionRecord(*(convert(getattr(a, f)) for f in a.__dataclass_fields__))
                for key, a in self.attention.items()
            },
            {key: convert(t) for key, t in self.layer_inputs.items()},
            {key: convert(t) for key, t in self.linear_inputs.items()},
            {key: convert(t) for key, t in self.linear_outputs.items()},
        )


def transformer_parts(model: nn.Module):
    """The encoder and decoder of a fairseq encoder-decoder Transformer, checked for what the
    rules cover; anything else is refused with the reason."""
    encoder, decoder = getattr(model, "encoder", None), getattr(model, "decoder", None)
    if encoder is None or decoder is None or not hasattr(decoder, "output_projection"):
        raise ValueError(
            "LRP head relevance needs a fairseq encoder-decoder Transformer "
            f"(transformer, transformer_local, ...); got {type(model).__name__}"
        )
    if getattr(decoder, "adaptive_softmax", None) is not None:
        raise ValueError("LRP head relevance does not support --adaptive-softmax-cutoff")
    for side, stack in (("encoder", encoder), ("decoder", decoder)):
        for index, layer in enumerate(stack.layers):
            layer = _unwrap(layer)
            for option in ("attn_ln", "c_attn", "ffn_layernorm", "w_resid"):
                if getattr(layer, option, None) is not None:
                    raise ValueError(
                        f"LRP head relevance: {side} layer {index} uses NormFormer's {option}, "
                        "which the relevance rules do not cover"
                    )
            if getattr(layer, "cross_self_attention", False):
                raise ValueError("LRP head relevance does not support --cross-self-attention")
            for name in ("self_attn", "encoder_attn"):
                attention = getattr(layer, name, None)
                if isinstance(attention, MultiheadAttention) and attention.bias_k is not None:
                    raise ValueError(
                        f"LRP head relevance: {side} layer {index} {name} uses add_bias_kv"
                    )
    return encoder, decoder


def _unwrap(layer):
    return getattr(layer, "module", layer)


class _Recorder:
    """Hooks that keep what the relevance rules need from one teacher-forced forward pass."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.record = ForwardRecord()
        self.handles = []
        self.restore = []  # (module, attribute, value) to put back on exit

    def __enter__(self):
        encoder, decoder = transformer_parts(self.model)
        for side, stack in (("encoder", encoder), ("decoder", decoder)):
            for index, layer in enumerate(stack.layers):
                layer = _unwrap(layer)
                self._keep_layer_input(layer, (side, index))
                for linear in (layer.fc1, layer.fc2):
                    self._keep_linear(linear)
                for name in ("self_attn", "encoder_attn"):
                    attention = getattr(layer, name, None)
                    if attention is not None and attention.num_heads:
                        self._keep_linear(attention.out_proj)
                        # fairseq's fused path skips the projection modules (and averages the
                        # weights over heads); the explicit path calls them
                        if isinstance(attention, MultiheadAttention):
                            self._set_attribute(attention, "skip_embed_dim_check", True)
        for linear in (decoder.project_out_dim, decoder.output_projection):
            if linear is not None:
                self._keep_linear(linear)
        self._attention_hooks = attention_hooks(self.model, self._ask_weights, self._keep_attention)
        self._attention_hooks.__enter__()
        return self.record

    def __exit__(self, *exc):
        self._attention_hooks.__exit__(*exc)
        for handle in self.handles:
            handle.remove()
        for module, name, value in self.restore:
            setattr(module, name, value)
        return False

    def _set_attribute(self, module, name, value):
        self.restore.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    def _keep_layer_input(self, layer, key):
        def hook(module, args, kwargs):
            self.record.layer_inputs[key] = args[0] if args else kwargs["x"]

        self.handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))

    def _keep_linear(self, linear):
        def hook(module, args, output):
            self.record.linear_inputs[module] = args[0]
            self.record.linear_outputs[module] = output

        self.handles.append(linear.register_forward_hook(hook))

    @staticmethod
    def _ask_weights(key, module, args, kwargs):
        return args, {**kwargs, "need_weights": True, "need_head_weights": True}

    def _keep_attention(self, key, module, args, kwargs, output):
        names = ("query", "key", "value")
        given = {**dict(zip(names, args)), **kwargs}
        value = given["value"] if given.get("value") is not None else given["query"]
        out, weights = output[0], output[1]
        head_outputs = self.record.linear_inputs.get(module.out_proj) if module.num_heads else None
        self.record.attention[key] = AttentionRecord(
            value_input=value,
            weights=weights.transpose(0, 1) if weights is not None else None,
            head_outputs=head_outputs,
            output=out,
        )


# -- propagation -------------------------------------------------------------------------------
@dataclass
class Relevance:
    """Relevance of one batch, per target step (teacher forcing) and sentence."""

    heads: Dict[AttentionKey, Tensor]  # (steps, bsz, heads), before normalisation over heads
    kept_heads: Dict[AttentionKey, List[int]]  # head numbers (pruned models keep some)
    steps_mask: Tensor  # (steps, bsz) bool: real target tokens
    top_tokens: Tensor  # (tgt_len, bsz): the top-1 predictions whose logits are explained
    # Total relevance (steps, bsz) at each layer's output and input, and what the decoder's
    # cross-attention passed to the encoder: the conservation the rules promise.
    layer_totals: Dict[Tuple[str, int], Dict[str, Tensor]]


@torch.no_grad()
def record_forward(model: nn.Module, sample: dict) -> Tuple[ForwardRecord, Optional[Tensor]]:
    """One forward pass in eval mode with everything the rules (and the head statistics) need:
    teacher-forced when the sample has a target (then also the logits), else the encoder only."""
    transformer_parts(model)
    net_input = sample["net_input"]
    was_training = model.training
    model.eval()
    try:
        with _Recorder(model) as record:
            if "prev_output_tokens" in net_input:
                logits = model(**net_input)[0]
            else:
                model.encoder(net_input["src_tokens"], src_lengths=net_input["src_lengths"])
                logits = None
    finally:
        model.train(was_training)
    return record, logits


def attention_weights(record: ForwardRecord) -> Dict[AttentionKey, Tensor]:
    """Per-head weights of every attention module that ran: (bsz, heads, tgt_len, src_len)."""
    return {key: a.weights for key, a in record.attention.items() if a.weights is not None}


@torch.no_grad()
def propagate_relevance(
    model: nn.Module, sample: dict, rule: Rule = Rule(), record: Optional[ForwardRecord] = None
) -> Relevance:
    """Relevance of every attention head for the top-1 logit of every target step of a batch
    (``record``: the :func:`record_forward` of this sample, if already run)."""
    if "prev_output_tokens" not in sample["net_input"]:
        raise ValueError("LRP head relevance needs target sentences (teacher forcing)")
    if record is None:
        record, _ = record_forward(model, sample)
    encoder, decoder = transformer_parts(model)
    prev = sample["net_input"]["prev_output_tokens"]  # (bsz, tgt_len)
    steps_mask = (prev != decoder.padding_idx).t()  # (tgt_len, bsz): each real step predicts
    logits = decoder.output_projection(record.linear_inputs[decoder.output_projection])
    top_tokens = logits.argmax(-1).t()  # (tgt_len, bsz)

    # float64: shares of opposite sign may cancel (rule "ratio"); conservation holds to rounding
    propagation = _Propagation(record.to(torch.float64), rule)
    relevance = propagation.vocabulary(decoder, top_tokens, steps_mask)
    encoder_relevance = 0
    for index in reversed(range(len(decoder.layers))):
        relevance, to_encoder = propagation.decoder_layer(_unwrap(decoder.layers[index]), index)
        encoder_relevance = encoder_relevance + to_encoder
    relevance = encoder_relevance  # the encoder's final LayerNorm (pre-norm) passes it on
    for index in reversed(range(len(encoder.layers))):
        relevance = propagation.encoder_layer(_unwrap(encoder.layers[index]), index, relevance)
    return Relevance(
        propagation.heads, propagation.kept_heads, steps_mask, top_tokens, propagation.totals
    )


class _Propagation:
    def __init__(self, record: ForwardRecord, rule: Rule):
        self.record, self.rule = record, rule
        self.heads: Dict[AttentionKey, Tensor] = {}
        self.kept_heads: Dict[AttentionKey, List[int]] = {}
        self.totals: Dict[Tuple[str, int], Dict[str, Tensor]] = {}
        self.relevance: Optional[Tensor] = None  # decoder stream, (steps, tgt, bsz, dim)

    def vocabulary(self, decoder, top_tokens: Tensor, steps_mask: Tensor) -> Tensor:
        """Relevance 1 on each step's top-1 logit, shared among the decoder's output features."""
        projection = decoder.output_projection
        features = self.record.linear_inputs[projection]  # (bsz, tgt, dim)
        features = features.transpose(0, 1)  # (tgt, bsz, dim)
        rows = projection.weight.to(features.dtype)[top_tokens]  # (tgt, bsz, dim)
        # each top-1 logit is a sum over the features' contributions
        contributions = features * rows
        pos, neg = _signs(contributions)
        seed = steps_mask[..., None].to(features.dtype)
        s_pos, s_neg = self.rule.scales(seed, pos.sum(-1, keepdim=True), neg.sum(-1, keepdim=True))
        steps = features.size(0)
        relevance = features.new_zeros(steps, *features.shape)
        index = torch.arange(steps, device=features.device)
        relevance[index, index] = pos * s_pos + neg * s_neg
        if decoder.project_out_dim is not None:
            inner = self.record.linear_inputs[decoder.project_out_dim].transpose(0, 1)
            relevance = relprop_linear(inner, decoder.project_out_dim.weight, relevance, self.rule)
        # the decoder's final LayerNorm (pre-norm) is passed through
        self.relevance = relevance
        return relevance

    def decoder_layer(self, layer, index: int) -> Tuple[Tensor, Tensor]:
        x = self.record.layer_inputs[("decoder", index)]
        blocks = [("self_attn", ("decoder_self", index), layer.self_attn_layer_norm)]
        if layer.encoder_attn is not None:
            blocks.append(("encoder_attn", ("decoder_cross", index), layer.encoder_attn_layer_norm))
        relevance_out = self.relevance
        relevance, to_encoder = self._layer(layer, x, blocks, relevance_out)
        self.totals[("decoder", index)] = {
            "output": _total(relevance_out),
            "input": _total(relevance),
            "encoder": _total(to_encoder) if torch.is_tensor(to_encoder) else None,
        }
        self.relevance = relevance
        return relevance, to_encoder

    def encoder_layer(self, layer, index: int, relevance_out: Tensor) -> Tensor:
        x = self.record.layer_inputs[("encoder", index)]
        blocks = [("self_attn", ("encoder_self", index), layer.self_attn_layer_norm)]
        relevance, _ = self._layer(layer, x, blocks, relevance_out)
        self.totals[("encoder", index)] = {
            "output": _total(relevance_out),
            "input": _total(relevance),
        }
        return relevance

    def _layer(self, layer, x: Tensor, attention_blocks, relevance: Tensor):
        """One layer: attention blocks then the FFN, each ``residual + update`` (LayerNorms, before
        or after, pass relevance through), walked from the top down. The bias of an update's last
        projection is a bias of the residual sum, not an input: a token whose FFN is silent
        (every ReLU off) passes all its relevance to the residual."""
        blocks = []  # (residual, update without its bias, relevance of the update -> its input)
        stream = x
        for name, key, norm in attention_blocks:
            attention = getattr(layer, name)
            update = self.record.attention[key].output
            propagate = (lambda r, a=attention, k=key: self._attention(a, k, r), name)
            blocks.append((stream, _without_bias(update, attention.out_proj), propagate))
            stream = stream + update
            if not layer.normalize_before:
                stream = norm(stream.to(norm.weight.dtype)).to(stream.dtype)
        update = _without_bias(self.record.linear_outputs[layer.fc2], layer.fc2)
        blocks.append((stream, update, (lambda r: self._ffn(layer, r), "ffn")))

        to_encoder = 0
        for residual, update, (propagate, name) in reversed(blocks):
            relevance, relevance_update = relprop_sum([residual, update], relevance, self.rule)
            relevance_input = propagate(relevance_update)
            if name == "encoder_attn":
                to_encoder = to_encoder + relevance_input
            else:
                relevance = relevance + relevance_input
        return relevance, to_encoder

    def _ffn(self, layer, relevance: Tensor) -> Tensor:
        hidden = self.record.linear_inputs[layer.fc2]  # after the activation
        relevance = relprop_linear(hidden, layer.fc2.weight, relevance, self.rule)
        # the activation passes relevance through to fc1's outputs
        inputs = self.record.linear_inputs[layer.fc1]
        return relprop_linear(inputs, layer.fc1.weight, relevance, self.rule)

    def _attention(self, attention, key: AttentionKey, relevance: Tensor) -> Tensor:
        """Relevance of the attention output -> its heads (recorded) -> its value input."""
        record = self.record.attention[key]
        if not attention.num_heads:  # every head pruned: the update was out_proj's bias alone
            return record.value_input.new_zeros(relevance.size(0), *record.value_input.shape)
        if record.weights is None:
            raise RuntimeError(f"{key}: the attention module returned no weights")
        relevance = relprop_linear(
            record.head_outputs, attention.out_proj.weight, relevance, self.rule
        )
        steps, tgt_len, bsz, _ = relevance.shape
        heads, head_dim = attention.num_heads, attention.head_dim
        per_head = relevance.view(steps, tgt_len, bsz, heads, head_dim)
        self.heads[key] = per_head.sum(dim=(1, 4))  # (steps, bsz, heads)
        self.kept_heads[key] = head_numbers(attention)
        # gates pass relevance through; the weights connect values to outputs
        per_head = per_head.permute(0, 2, 3, 1, 4)  # (steps, bsz, heads, tgt, head_dim)
        value_input = record.value_input
        projection = attention.v_proj
        bias = None if projection.bias is None else projection.bias.to(value_input.dtype)
        values = F.linear(value_input, projection.weight.to(value_input.dtype), bias)
        src_len = values.size(0)
        values = values.view(src_len, bsz, heads, head_dim).permute(1, 2, 0, 3)
        relevance_values = relprop_attention(record.weights, values, per_head, self.rule)
        relevance_values = relevance_values.permute(0, 3, 1, 2, 4).reshape(
            steps, src_len, bsz, heads * head_dim
        )
        return relprop_linear(value_input, attention.v_proj.weight, relevance_values, self.rule)


def _without_bias(output: Tensor, linear: nn.Linear) -> Tensor:
    return output if linear.bias is None else output - linear.bias.to(output.dtype)


def _total(relevance: Tensor) -> Tensor:
    """(steps, len, bsz, dim) -> (steps, bsz)."""
    return relevance.sum(dim=(1, 3))


# -- averaging over a data set ---------------------------------------------------------------
class HeadRelevance:
    """Running mean over target steps of each head's normalised relevance."""

    def __init__(self, types=ATTENTION_TYPES):
        self.types = tuple(types)
        self.sums: Dict[AttentionKey, Tensor] = {}
        self.counts: Dict[AttentionKey, int] = {}
        self.kept_heads: Dict[AttentionKey, List[int]] = {}

    def add(self, relevance: Relevance):
        mask = relevance.steps_mask.to(torch.float64)
        for key, heads in relevance.heads.items():
            if key[0] not in self.types:
                continue
            shares = normalise_over_heads(heads.double()) * mask[..., None]
            self.sums[key] = self.sums.get(key, 0) + shares.sum(dim=(0, 1)).cpu()
            self.counts[key] = self.counts.get(key, 0) + int(mask.sum())
            self.kept_heads[key] = relevance.kept_heads[key]

    def means(self) -> Dict[AttentionKey, Tensor]:
        return {key: self.sums[key] / max(self.counts[key], 1) for key in sorted(self.sums)}
