"""Decoding at long lengths: the models decode one token at a time through fairseq's incremental
state, as fairseq's SequenceGenerator calls them (the decoder given the whole prefix, the state
holding the cached keys and values), from a short prompt, greedily; all of them step by step in
lockstep, so that a shared machine's drifts fall on all alike. The local model decodes twice,
with its rolling window cache and with ``LOCAL_ATTN_FULL_DECODER_CACHE=1``, the full cache fed
the rolling cache's tokens so that every step's logits can be compared. At each length t: the
median time per token over the steps ending at t, and the bytes each layer's cache holds (the
buffers its tensors keep alive: a slice holds its whole buffer).

Past the last lockstep length the rolling cache decodes on alone (the others' time per token
grows with t) to each rolling length t; its steps ending at t are timed side by side with a
second rolling decoder started afresh from the prompt, whose steps end at the first lockstep
length, so that the growth from that length to t is a ratio of one moment of the machine.
"""

import contextlib
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from ...modules.rolling_cache import FULL_CACHE_VARIABLE
from .models import LanguageModelBuilder, random_words
from .settings import Settings, contenders

# eos and 7 words, fed one at a time as fairseq's generator feeds a prefix
PROMPT_TOKENS = 8
# float32 logits of the same computation over the same keys; rounding alone differs
LOGIT_TOLERANCE = 1e-4
REPORT_SECONDS = 30  # between progress lines


@contextlib.contextmanager
def decoder_cache(full: bool):
    """LOCAL_ATTN_FULL_DECODER_CACHE set (full) or unset (rolling) inside the block, whatever
    the environment says outside it; read by the layers at every step."""
    saved = os.environ.get(FULL_CACHE_VARIABLE)
    if full:
        os.environ[FULL_CACHE_VARIABLE] = "1"
    else:
        os.environ.pop(FULL_CACHE_VARIABLE, None)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(FULL_CACHE_VARIABLE, None)
        else:
            os.environ[FULL_CACHE_VARIABLE] = saved


def layer_cache_bytes(model, incremental_state) -> List[int]:
    """Bytes each decoder layer's cache holds: the buffers of the tensors in its self-attention's
    incremental state, each buffer once (a slice keeps its whole buffer alive)."""
    sizes = []
    for layer in model.decoder.layers:
        buffers = {}
        state = layer.self_attn.get_incremental_state(incremental_state, "attn_state") or {}
        for tensor in state.values():
            if tensor is not None:
                storage = tensor.untyped_storage()
                buffers[storage.data_ptr()] = storage.nbytes()
        sizes.append(sum(buffers.values()))
    return sizes


@dataclass
class Decoder:
    """One way of decoding: a model, its incremental state and the tokens it is fed."""

    name: str
    model: torch.nn.Module
    full_cache: bool
    tokens: torch.Tensor  # (1, steps + 1)
    first_word: int  # the dictionary's first ordinary word: the special symbols come before
    state: dict = field(default_factory=dict)
    step_seconds: List[float] = field(default_factory=list)
    cache_bytes: Dict[int, List[int]] = field(default_factory=dict)  # t -> per layer
    logits: Optional[torch.Tensor] = None  # of the last step

    def step(self, index: int) -> None:
        """Feed token ``index`` (the decoder takes the whole prefix and the state, as the
        sequence generator calls it) and keep the next token's logits."""
        prefix = self.tokens[:, : index + 1]
        with decoder_cache(self.full_cache):
            start = time.perf_counter()
            out, _ = self.model.decoder(prefix, incremental_state=self.state)
            self.step_seconds.append(time.perf_counter() - start)
        self.logits = out[0, -1]

    def restarted(self, name: str, steps: int) -> "Decoder":
        """A decoder of the same model and cache from the same prompt, with an empty state and
        room for ``steps`` steps."""
        tokens = self.tokens[:, : steps + 1].clone()  # past the prompt, written step by step
        return Decoder(name, self.model, self.full_cache, tokens, self.first_word)

    def advance(self, index: int) -> None:
        """``step``, and after the prompt feed the greedy choice as the next token."""
        self.step(index)
        if index + 1 >= PROMPT_TOKENS:
            self.tokens[0, index + 1] = self.greedy()

    def greedy(self) -> torch.Tensor:
        """The likeliest word: never a special symbol (fairseq's generator never emits padding,
        nor eos before --min-len, which here is every step)."""
        return self.logits[self.first_word :].argmax() + self.first_word

    def ms_per_token(self, t: int, steps: int) -> float:
        """Median time of the ``steps`` steps that end at length t, in ms."""
        return statistics.median(self.step_seconds[t - steps : t]) * 1e3


@dataclass
class RollingPoint:
    """The rolling cache alone at t, timed beside a fresh one at the first lockstep length."""

    t: int
    ms_per_token: float
    reference_t: int
    reference_ms_per_token: float
    cache_bytes_per_layer: List[int]

    def record(self) -> dict:
        growth = self.ms_per_token / self.reference_ms_per_token
        return dict(vars(self), ms_per_token_over_reference=growth)


@dataclass
class DecodingResult:
    decoders: Dict[str, Decoder]
    steps_compared: int
    same_tokens: bool  # the full cache's greedy choice equals the rolling cache's at every step
    max_logit_difference: float
    rolling_points: List[RollingPoint] = field(default_factory=list)

    @property
    def agree(self) -> bool:
        return self.same_tokens and self.max_logit_difference <= LOGIT_TOLERANCE


def prompted_decoders(builder: LanguageModelBuilder) -> Dict[str, Decoder]:
    """Global, local with its rolling cache, and the same local model with the full cache, each
    with its own state, all fed the same prompt."""
    settings = builder.settings
    by_name = {c.name: c for c in contenders(settings)}
    global_model, _, _ = builder.build(by_name["global"])
    local_model, _, task = builder.build(by_name["local"])
    dictionary = task.source_dictionary
    prompt = random_words(task, PROMPT_TOKENS, torch.Generator().manual_seed(1))
    prompt[0] = dictionary.eos()  # fairseq's LM prefixes start with eos

    def prompted(name, model, full_cache):
        tokens = torch.full((1, settings.longest_decode + 1), dictionary.pad())
        tokens[0, :PROMPT_TOKENS] = prompt
        return Decoder(name, model.eval(), full_cache, tokens, dictionary.nspecial)

    return {
        "global": prompted("global", global_model, False),
        "local": prompted("local", local_model, False),
        "local_full_cache": prompted("local_full_cache", local_model, True),
    }


def decode(builder: LanguageModelBuilder, progress: Callable[[str], None]) -> DecodingResult:
    """All three decoders step by step in lockstep (in reversed order every other step), greedy
    after the prompt; the full cache is fed the rolling cache's tokens, and at every step its
    logits and greedy choice are compared with the rolling cache's."""
    settings = builder.settings
    decoders = prompted_decoders(builder)
    rolling, full = decoders["local"], decoders["local_full_cache"]
    order = list(decoders.values())
    steps = max(settings.decode_lengths)
    same_tokens, max_difference = True, 0.0
    last_report = time.monotonic()
    with torch.no_grad():
        for index in range(steps):
            for decoder in order if index % 2 == 0 else order[::-1]:
                decoder.step(index)
            max_difference = max(max_difference, (rolling.logits - full.logits).abs().max().item())
            if index + 1 >= PROMPT_TOKENS:
                for decoder in (decoders["global"], rolling):
                    decoder.tokens[0, index + 1] = decoder.greedy()
                full.tokens[0, index + 1] = rolling.tokens[0, index + 1]
                same_tokens &= bool(full.greedy() == rolling.greedy())
            t = index + 1
            if t in settings.decode_lengths:
                for decoder in order:
                    decoder.cache_bytes[t] = layer_cache_bytes(decoder.model, decoder.state)
            if t in settings.decode_lengths or time.monotonic() - last_report > REPORT_SECONDS:
                last_report = time.monotonic()
                window = min(t, settings.timing_steps)
                times = ", ".join(f"{d.name} {d.ms_per_token(t, window):.2f}" for d in order)
                progress(f"decoding t={t}/{steps}: ms per token {times}")
        result = DecodingResult(decoders, steps, same_tokens, max_difference)
        result.rolling_points = decode_on(builder, rolling, progress)
    return result


def decode_on(
    builder: LanguageModelBuilder, rolling: Decoder, progress: Callable[[str], None]
) -> List[RollingPoint]:
    """The rolling decoder on from where the lockstep stopped to each rolling length t; its
    last ``timing_steps`` steps before t alternate with those of a fresh rolling decoder of the
    same model ending at the first lockstep length (its earlier steps untimed)."""
    settings = builder.settings
    steps, reference_t = settings.timing_steps, settings.decode_lengths[0]
    points, last_report = [], time.monotonic()
    index = len(rolling.step_seconds)
    for t in settings.rolling_decode_lengths:
        while index < t - steps:
            rolling.advance(index)
            index += 1
            if time.monotonic() - last_report > REPORT_SECONDS:
                last_report = time.monotonic()
                ms = rolling.ms_per_token(index, min(index, steps))
                progress(f"decoding on, rolling cache alone: t={index}/{t}, {ms:.2f} ms per token")
        reference = rolling.restarted("reference", reference_t)
        for reference_index in range(reference_t - steps):
            reference.advance(reference_index)
        for offset in range(steps):
            pair = (rolling, index), (reference, reference_t - steps + offset)
            for decoder, at in pair if offset % 2 == 0 else pair[::-1]:
                decoder.advance(at)
            index += 1
        point = RollingPoint(
            t,
            rolling.ms_per_token(t, steps),
            reference_t,
            reference.ms_per_token(reference_t, steps),
            layer_cache_bytes(rolling.model, rolling.state),
        )
        points.append(point)
        progress(
            f"decoding on, rolling cache alone: t={t} {point.ms_per_token:.2f} ms per token, "
            f"t={reference_t} beside it {point.reference_ms_per_token:.2f}"
        )
    return points


def decoding_record(settings: Settings, result: DecodingResult) -> dict:
    """The record's decoding part: time and cache bytes at each t, and the comparison of the
    rolling cache with the full one."""
    decoders = result.decoders
    points = []
    for t in settings.decode_lengths:
        steps = min(t, settings.timing_steps)
        full = sum(decoders["local_full_cache"].cache_bytes[t])
        point = {"t": t, "timed_steps": steps, "window_share": (settings.window + 1) / t}
        for name, decoder in decoders.items():
            point[name] = {
                "ms_per_token": decoder.ms_per_token(t, steps),
                "cache_bytes_per_layer": decoder.cache_bytes[t],
            }
        point["local_cache_over_full"] = sum(decoders["local"].cache_bytes[t]) / full
        points.append(point)
    first, last = points[0], points[-1]
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "points": points,
        "ms_per_token_last_over_first": {
            name: last[name]["ms_per_token"] / first[name]["ms_per_token"] for name in decoders
        },
        "rolling_cache_alone": [point.record() for point in result.rolling_points],
        "rolling_vs_full_cache": {
            "steps": result.steps_compared,
            "same_greedy_tokens": result.same_tokens,
            "max_abs_logit_difference": result.max_logit_difference,
            "tolerance": LOGIT_TOLERANCE,
            "agree": result.agree,
        },
    }
