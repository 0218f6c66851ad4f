"""The memory a model needs to train at T, measured and estimated.

Measured: the peak of torch's CPU allocations from the model's construction through its first
two training steps (parameters, buffers, gradients, Adam's two moments, activations and what
the model caches, such as the (T, T) causal mask fairseq's decoder keeps), read from the
allocation events of torch's profiler (``measurement.cpu_allocation_peak``). Estimated, before
a model runs at T: the memory that grows as T^2 (the attention of each layer and the decoder's
causal mask, measured at three short lengths), four times the parameters' bytes, and the rest,
which grows linearly (extrapolated from the model's own measurements at shorter lengths).
"""

import gc
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch

from ..measurement import cpu_allocation_peak, peak_bytes
from .models import (
    LanguageModelBuilder,
    Trainer,
    build_trainer,
    parameter_bytes,
    parameter_count,
)
from .settings import Contender, contenders


def trained_twice(
    builder: LanguageModelBuilder, contender: Contender, length: int
) -> Tuple[Trainer, int]:
    """A trainer of ``contender`` on one sequence of ``length`` tokens, and its training
    memory: the peak of torch's allocations from the model's construction through two training
    steps (after the first, Adam's moments exist and the decoder's causal mask is cached; both
    stay live through the second)."""
    built = []

    def build_and_train():
        built.append(build_trainer(builder, contender, length))
        built[0].step()
        built[0].step()

    peak = cpu_allocation_peak(build_and_train)
    return built[0], peak


def out_of_memory(error: BaseException) -> bool:
    """Whether an exception says an allocation failed (torch's CPU allocator raises a
    RuntimeError, not a MemoryError)."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:160] if text else ''}"


def measured_trainer(
    builder: LanguageModelBuilder, contender: Contender, length: int
) -> Tuple[Optional[Trainer], int, str]:
    """``trained_twice`` as (trainer, peak bytes, ""), or (None, 0, why) where it ran out of
    memory; any other error is raised."""
    try:
        return (*trained_twice(builder, contender, length), "")
    except Exception as error:
        if not out_of_memory(error):
            raise
        why = f"out of memory ({_short(error)})"
    gc.collect()  # after the except block, which holds the failed step's frames
    return None, 0, why


def quadratic_coefficient(lengths: Sequence[int], peaks: Sequence[int]) -> float:
    """c of the a + b T + c T^2 through three (length, bytes) points; 0 where it is negative
    (memory that grows no faster than linearly at these lengths)."""
    (t1, m1), (t2, m2), (t3, m3) = zip(lengths, peaks)
    c = ((m3 - m2) / (t3 - t2) - (m2 - m1) / (t2 - t1)) / (t3 - t1)
    return max(0.0, c)


def attention_peak(module: torch.nn.Module, length: int, attn_mask: Optional[torch.Tensor]) -> int:
    """Peak bytes of one forward + backward of a decoder self-attention module on one sequence,
    called as fairseq's decoder layer calls it, with the decoder's own ``attn_mask`` (built
    beforehand: the decoder builds it once for all layers). The module's parameters must not
    require gradients: theirs are constant and would hide the T^2 term at short lengths."""
    x = torch.randn(length, 1, module.embed_dim, requires_grad=True)

    def forward(x):
        return module(x, x, x, need_weights=False, attn_mask=attn_mask)[0]

    return peak_bytes(forward, [x], backward=True)


def quadratic_bytes_per_square(model, lengths: Sequence[int]) -> float:
    """Training bytes per T^2 of a language model: each layer's self-attention (T x T
    matrices kept for backward, temporaries of one layer counted in every layer: an upper
    bound) and the decoder's causal mask, each measured at three short lengths."""
    for p in model.parameters():  # a throwaway model: frozen for the probes only
        p.requires_grad_(False)
    decoder = model.decoder
    mask_peaks = [
        cpu_allocation_peak(lambda t=t: decoder.buffered_future_mask(torch.empty(t, 1, 1)))
        for t in lengths
    ]
    total = quadratic_coefficient(lengths, mask_peaks)
    # the mask the decoder gives its layers at each length (None where they take none)
    masks = [decoder.buffered_future_mask(torch.empty(t, 1, 1)) for t in lengths]
    by_kind: Dict[str, float] = {}  # layers whose heads do the same cost the same
    for layer in decoder.layers:
        module = layer.self_attn
        kind = f"{type(module).__name__} {getattr(module, 'head_specs', None)!r}"
        if kind not in by_kind:
            peaks = [attention_peak(module, t, mask) for t, mask in zip(lengths, masks)]
            by_kind[kind] = quadratic_coefficient(lengths, peaks)
        total += by_kind[kind]
    return total


def estimated_bytes(
    length: int, per_square: float, constant: int, measured: Dict[int, int]
) -> float:
    """Training memory at ``length``: ``per_square`` x T^2, ``constant`` (parameters, their
    gradients, Adam's two moments), and the rest, which grows linearly: the line through the
    two longest shorter lengths ``measured`` (length -> bytes) for this model, through the
    origin with one, nothing without."""
    linear = {
        t: max(0.0, m - per_square * t * t - constant) for t, m in measured.items() if t < length
    }
    points = sorted(linear.items())[-2:]
    rest = 0.0
    if len(points) == 2:
        (t1, r1), (t2, r2) = points
        rest = r2 + max(0.0, (r2 - r1) / (t2 - t1)) * (length - t2)
    elif points:
        rest = points[0][1] * length / points[0][0]
    return per_square * length * length + constant + rest


@dataclass
class ModelInfo:
    """What a model's estimate needs: its parameters and its training bytes per T^2."""

    contender: Contender
    parameters: int
    parameter_bytes: int
    per_square: float  # training bytes per T^2

    @property
    def constant_bytes(self) -> int:
        """Parameters, their gradients and Adam's two moments."""
        return 4 * self.parameter_bytes

    def estimated_bytes(self, length: int, measured: Dict[int, int]) -> float:
        """Training memory at ``length``, from this model's ``measured`` shorter lengths."""
        return estimated_bytes(length, self.per_square, self.constant_bytes, measured)

    def record(self) -> dict:
        return {
            "arch": self.contender.arch,
            "locality_config": self.contender.locality_config,
            "parameters": self.parameters,
            "training_bytes_per_length_squared": self.per_square,
        }


def describe_models(builder: LanguageModelBuilder) -> Dict[str, ModelInfo]:
    """Each model's ModelInfo, its T^2 term measured at the settings' probe lengths."""
    infos = {}
    for contender in contenders(builder.settings):
        model, _, _ = builder.build(contender)
        infos[contender.name] = ModelInfo(
            contender,
            parameter_count(model),
            parameter_bytes(model),
            quadratic_bytes_per_square(model, builder.settings.probe_lengths),
        )
    return infos
