"""Long contexts on the CPU: fairseq's ``transformer_lm`` against ``transformer_lm_local`` with
every decoder head ``local-W``, and with mixed layers (some global heads, the rest ``local-W``),
in training and in incremental decoding (``benchmarks/long_context.py``).

Training: seconds of one step (forward, backward, Adam) on one sequence of T tokens, the three
models alternating in rounds within one process (``measurement.alternating_rounds``), words/s
from the median; and the memory a model needs to train at T: the peak of torch's CPU
allocations from the model's construction through its first two training steps (parameters,
buffers, gradients, Adam's two moments, activations and what the model caches, such as the
(T, T) causal mask fairseq's decoder keeps), read from the allocation events of torch's
profiler. A configuration whose estimated memory exceeds the cap, or that runs out of memory,
is reported as not fitting instead of ending the run. The estimate: the memory that grows as
T^2 (the attention matrices of each layer and the decoder's causal mask, measured at three short
lengths) plus the rest, which grows linearly (extrapolated from the configuration's own
measurements at the shorter lengths of the run).

Decoding: the models decode one token at a time through fairseq's incremental state, as
fairseq's SequenceGenerator calls them (the decoder given the whole prefix, the state holding
the cached keys and values), from a short prompt, greedily; all of them step by step in
lockstep, so that a shared machine's drifts fall on all alike. The local model decodes twice,
with its rolling window cache and with ``LOCAL_ATTN_FULL_DECODER_CACHE=1``, the full cache fed
the rolling cache's tokens so that every step's logits can be compared. At each length t: the
median time per token over the steps ending at t, and the bytes each layer's cache holds (the
buffers its tensors keep alive: a slice holds its whole buffer).
"""

import contextlib
import datetime
import gc
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import fairseq
import torch
from fairseq import options as fairseq_options
from fairseq import tasks

from ..modules.rolling_cache import FULL_CACHE_VARIABLE
from .measurement import (
    DictionaryFolder,
    alternating_rounds,
    cpu_allocation_peak,
    peak_bytes,
)

GiB, MiB, KiB = 2**30, 2**20, 2**10
# eos and 7 words, fed one at a time as fairseq's generator feeds a prefix
PROMPT_TOKENS = 8
# float32 logits of the same computation over the same keys; rounding alone differs
LOGIT_TOLERANCE = 1e-4
# The probes that measure the T^2 memory end at the longest T or here: long enough that
# constant buffers no longer blur the T^2 term, short enough to be cheap at every T.
LONGEST_PROBE = 2048

FULL_SIZES = dict(
    lengths=(1024, 4096, 16384), layers=6, dims=512, heads=8, global_heads=2, window=64,
    vocab_size=1000, rounds=3, decode_lengths=(512, 2048, 8192), timing_steps=64,
    memory_cap_gb=8.0,
)  # fmt: skip
QUICK_SIZES = dict(
    FULL_SIZES, lengths=(64, 256), layers=2, dims=64, window=8, rounds=2,
    decode_lengths=(16, 64), timing_steps=8,
)  # fmt: skip


@dataclass(frozen=True)
class Settings:
    lengths: Tuple[int, ...]  # training sequence lengths, ascending
    layers: int
    dims: int
    heads: int
    global_heads: int  # of the mixed layers
    window: int  # keys behind the query of every local head
    vocab_size: int
    rounds: int
    decode_lengths: Tuple[int, ...]  # ascending
    timing_steps: int  # decoding steps timed up to each decode length
    memory_cap_gb: float

    @property
    def memory_cap_bytes(self) -> int:
        return int(self.memory_cap_gb * GiB)

    @property
    def max_positions(self) -> int:
        """Positions every model is built with: the longest training sequence, or the prompt
        and every decoded token (fairseq's generator stops at a model's positions)."""
        return max(max(self.lengths), max(self.decode_lengths) + 1)

    @property
    def probe_lengths(self) -> Tuple[int, int, int]:
        longest = min(LONGEST_PROBE, max(self.lengths))
        return longest // 4, longest // 2, longest


@dataclass(frozen=True)
class Contender:
    name: str
    arch: str
    locality_config: Optional[str] = None


def decoder_spec(heads: Sequence[str]) -> str:
    """A locality spec giving every decoder layer these heads."""
    return "{decoder_self: {all: [" + ", ".join(heads) + "]}}"


def contenders(settings: Settings) -> Tuple[Contender, ...]:
    local = f"local-{settings.window}"
    mixed = ["global"] * settings.global_heads + [local] * (settings.heads - settings.global_heads)
    return (
        Contender("global", "transformer_lm"),
        Contender("local", "transformer_lm_local", decoder_spec([local] * settings.heads)),
        Contender("mixed", "transformer_lm_local", decoder_spec(mixed)),
    )


def lm_arguments(
    data_dir: str,
    arch: str,
    *,
    layers: int,
    dims: int,
    heads: int,
    max_positions: int,
    locality_config: Optional[str] = None,
) -> List[str]:
    """fairseq-train's arguments for a language model of these sizes (FFN 4 x dims, pre-norm),
    of fairseq's ``transformer_lm`` or the plugin's ``transformer_lm_local``.

    ``transformer_lm`` takes its defaults from its dataclass, not from ``base_lm_architecture``
    as ``transformer_lm_local`` does: 512 input and output dims whatever the embedding's, and
    post-norm. Both are given, so that the two have the same parameters and layer order.
    """
    arguments = [
        data_dir, "--task", "language_modeling", "--arch", arch,
        "--decoder-layers", str(layers), "--decoder-attention-heads", str(heads),
        "--decoder-embed-dim", str(dims), "--decoder-input-dim", str(dims),
        "--decoder-output-dim", str(dims), "--decoder-ffn-embed-dim", str(4 * dims),
        "--decoder-normalize-before", "--tokens-per-sample", str(max_positions),
        "--max-target-positions", str(max_positions), "--criterion", "cross_entropy",
    ]  # fmt: skip
    if locality_config is not None:
        arguments += ["--locality-config", locality_config]
    return arguments


class LanguageModelBuilder(DictionaryFolder):
    """Models of fairseq's language_modeling task built by fairseq's own argument parsing, as
    fairseq-train builds them; the task needs nothing but a dictionary."""

    def __init__(self, settings: Settings):
        super().__init__("long_context_", words=settings.vocab_size)
        self.settings = settings

    def build(self, contender: Contender):
        """(model, criterion, task), the model in training mode."""
        s = self.settings
        arguments = lm_arguments(
            self.path, contender.arch, layers=s.layers, dims=s.dims, heads=s.heads,
            max_positions=s.max_positions, locality_config=contender.locality_config,
        )  # fmt: skip
        parser = fairseq_options.get_training_parser()
        args = fairseq_options.parse_args_and_arch(parser, arguments)
        task = tasks.setup_task(args)
        return task.build_model(args).train(), task.build_criterion(args), task


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def random_words(task, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` ids of ordinary words (no special symbols) of the task's dictionary."""
    dictionary = task.source_dictionary
    return torch.randint(dictionary.nspecial, len(dictionary), (count,), generator=generator)


def one_sequence(task, length: int, seed: int = 0) -> dict:
    """A language_modeling batch of one sequence of ``length`` tokens, as fairseq builds it."""
    tokens = random_words(task, length + 1, torch.Generator().manual_seed(seed))[None]
    return {
        "id": torch.tensor([0]),
        "nsentences": 1,
        "ntokens": length,
        "net_input": {"src_tokens": tokens[:, :-1], "src_lengths": torch.tensor([length])},
        "target": tokens[:, 1:],
    }


# -- training ---------------------------------------------------------------------------------


@dataclass
class Trainer:
    model: torch.nn.Module
    criterion: torch.nn.Module
    optimizer: torch.optim.Optimizer
    sample: dict

    def step(self) -> float:
        """Seconds of one training step: forward, backward, Adam."""
        start = time.perf_counter()
        loss, _, _ = self.criterion(self.model, self.sample)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start


def build_trainer(builder: LanguageModelBuilder, contender: Contender, length: int) -> Trainer:
    model, criterion, task = builder.build(contender)
    # as benchmarks/training_throughput.py: torch's Adam on the float32 parameters
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98))
    return Trainer(model, criterion, optimizer, one_sequence(task, length))


def out_of_memory(error: BaseException) -> bool:
    """Whether an exception says an allocation failed (torch's CPU allocator raises a
    RuntimeError, not a MemoryError)."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


def trained_twice(make: Callable[[], Trainer]) -> Tuple[Trainer, int]:
    """The trainer ``make()`` builds and its memory: the peak of torch's allocations from the
    model's construction through two training steps (after the first, Adam's moments exist
    and the decoder's causal mask is cached; both stay live through the second)."""
    built = []

    def build_and_train():
        built.append(make())
        built[0].step()
        built[0].step()

    peak = cpu_allocation_peak(build_and_train)
    return built[0], peak


def quadratic_coefficient(lengths: Sequence[int], peaks: Sequence[int]) -> float:
    """c of the a + b T + c T^2 through three (length, bytes) points; 0 where it is negative
    (memory that grows no faster than linearly at these lengths)."""
    (t1, m1), (t2, m2), (t3, m3) = zip(lengths, peaks)
    c = ((m3 - m2) / (t3 - t2) - (m2 - m1) / (t2 - t1)) / (t3 - t1)
    return max(0.0, c)


def causal_mask(length: int) -> torch.Tensor:
    """The additive (T, T) causal mask fairseq's decoder gives its self-attention layers."""
    return torch.triu(torch.full((length, length), float("-inf")), 1)


def attention_peak(module: torch.nn.Module, length: int) -> int:
    """Peak bytes of one forward + backward of a decoder self-attention module on one sequence,
    called as fairseq's decoder layer calls it (mask built beforehand: the decoder builds it
    once for all layers). The module's parameters must not require gradients: theirs are
    constant and would hide the T^2 term at short lengths."""
    x = torch.randn(length, 1, module.embed_dim, requires_grad=True)
    mask = causal_mask(length)

    def forward(x):
        return module(x, x, x, need_weights=False, attn_mask=mask)[0]

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
    by_kind: Dict[str, float] = {}  # layers whose heads do the same cost the same
    for layer in decoder.layers:
        module = layer.self_attn
        kind = f"{type(module).__name__} {getattr(module, 'head_specs', None)!r}"
        if kind not in by_kind:
            peaks = [attention_peak(module, t) for t in lengths]
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
class TrainingCell:
    """One model at one length."""

    contender: str
    length: int
    estimated_bytes: float
    peak_bytes: Optional[int] = None
    step_seconds: List[float] = field(default_factory=list)
    does_not_fit: str = ""  # why, when it does not

    @property
    def words_per_second(self) -> Optional[float]:
        if not self.step_seconds:
            return None
        return self.length / statistics.median(self.step_seconds)

    def record(self) -> dict:
        rates = [self.length / s for s in self.step_seconds]
        return {
            "fits": not self.does_not_fit,
            "does_not_fit": self.does_not_fit or None,
            "words_per_second": self.words_per_second,
            "words_per_second_rounds": rates,
            "peak_bytes": self.peak_bytes,
            "estimated_bytes": round(self.estimated_bytes),
        }


@dataclass
class ModelInfo:
    contender: Contender
    parameters: int
    parameter_bytes: int
    per_square: float  # training bytes per T^2

    def record(self) -> dict:
        return {
            "arch": self.contender.arch,
            "locality_config": self.contender.locality_config,
            "parameters": self.parameters,
            "training_bytes_per_length_squared": self.per_square,
        }


def describe_models(builder: LanguageModelBuilder) -> Dict[str, ModelInfo]:
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


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:160] if text else ''}"


def measured_trainer(make: Callable[[], Trainer]) -> Tuple[Optional[Trainer], int, str]:
    """``trained_twice(make)`` as (trainer, peak bytes, ""), or (None, 0, why) where it ran out
    of memory; any other error is raised."""
    try:
        return (*trained_twice(make), "")
    except Exception as error:
        if not out_of_memory(error):
            raise
        why = f"out of memory ({_short(error)})"
    gc.collect()  # after the except block, which holds the failed step's frames
    return None, 0, why


def train_at_length(
    builder: LanguageModelBuilder,
    infos: Dict[str, ModelInfo],
    length: int,
    measured: Dict[str, Dict[int, int]],
    progress: Callable[[str], None],
) -> Dict[str, TrainingCell]:
    """Every model at one length: the fit check, the memory (with two untimed steps that
    also warm up), then the timed rounds of those that fit. ``measured`` (model -> length ->
    peak bytes) holds the shorter lengths' memory for the estimate and gains this one's."""
    settings = builder.settings
    cells, trainers = {}, {}
    for name, info in infos.items():
        constant = 4 * info.parameter_bytes
        estimate = estimated_bytes(length, info.per_square, constant, measured[name])
        cell = cells[name] = TrainingCell(name, length, estimate)
        if estimate > settings.memory_cap_bytes:
            cell.does_not_fit = (
                f"estimated {estimate / GiB:.2f} GiB > cap {settings.memory_cap_gb:g} GiB"
            )
        else:
            progress(f"T={length} {name}: building, two untimed steps (memory)")
            trainer, peak, cell.does_not_fit = measured_trainer(
                lambda: build_trainer(builder, info.contender, length)
            )
        if cell.does_not_fit:
            progress(f"T={length} {name}: does not fit ({cell.does_not_fit})")
            continue
        cell.peak_bytes = measured[name][length] = peak
        trainers[name] = trainer
        progress(f"T={length} {name}: {peak / MiB:.0f} MiB (estimated {estimate / MiB:.0f})")

    def timed(name):
        def step():
            seconds = trainers[name].step()
            progress(f"T={length} {name}: {seconds:.2f} s/step, {length / seconds:.0f} words/s")
            return seconds

        return step

    rounds = alternating_rounds({name: timed(name) for name in trainers}, settings.rounds)
    for name, seconds in rounds.items():
        cells[name].step_seconds = seconds
    trainers.clear()
    gc.collect()
    return cells


# -- decoding ---------------------------------------------------------------------------------


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

    def greedy(self) -> torch.Tensor:
        """The likeliest word: never a special symbol (fairseq's generator never emits padding,
        nor eos before --min-len, which here is every step)."""
        return self.logits[self.first_word :].argmax() + self.first_word

    def ms_per_token(self, t: int, steps: int) -> float:
        """Median time of the ``steps`` steps that end at length t, in ms."""
        return statistics.median(self.step_seconds[t - steps : t]) * 1e3


@dataclass
class DecodingResult:
    decoders: Dict[str, Decoder]
    steps_compared: int
    same_tokens: bool  # the full cache's greedy choice equals the rolling cache's at every step
    max_logit_difference: float

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
        tokens = torch.full((1, max(settings.decode_lengths) + 1), dictionary.pad())
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
            if t in settings.decode_lengths or time.monotonic() - last_report > 30:
                last_report = time.monotonic()
                window = min(t, settings.timing_steps)
                times = ", ".join(f"{d.name} {d.ms_per_token(t, window):.2f}" for d in order)
                progress(f"decoding t={t}/{steps}: ms per token {times}")
    return DecodingResult(decoders, steps, same_tokens, max_difference)


# -- the run, its table and its record ----------------------------------------------------------


def machine() -> dict:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    return {
        "device": "cpu",
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "fairseq": fairseq.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def training_ratios(cells: Dict[str, TrainingCell]) -> dict:
    base = cells["global"]
    return {
        f"{name}/global": {
            "words_per_second": _ratio(cell.words_per_second, base.words_per_second),
            "memory": _ratio(cell.peak_bytes, base.peak_bytes),
        }
        for name, cell in cells.items()
        if name != "global"
    }


def decoding_record(settings: Settings, result: DecodingResult) -> dict:
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
        "rolling_vs_full_cache": {
            "steps": result.steps_compared,
            "same_greedy_tokens": result.same_tokens,
            "max_abs_logit_difference": result.max_logit_difference,
            "tolerance": LOGIT_TOLERANCE,
            "agree": result.agree,
        },
    }


def settings_record(settings: Settings) -> dict:
    record = dict(vars(settings))
    record.update(
        ffn_dims=4 * settings.dims,
        memory_cap_bytes=settings.memory_cap_bytes,
        probe_lengths=settings.probe_lengths,
        max_positions=settings.max_positions,
    )
    return record


def run(
    settings: Settings,
    progress: Callable[[str], None],
    save: Callable[[dict], None],
) -> dict:
    """Training at every length, then decoding; ``save`` gets the record after every length and
    at the end (``complete`` then true), so that a run cut short keeps what it measured."""
    record = {
        "benchmark": "long_context",
        "complete": False,
        "machine": machine(),
        "settings": settings_record(settings),
        "training": [],
        "decoding": None,
    }
    torch.manual_seed(0)  # the same initial weights (and dropout) on every run
    with LanguageModelBuilder(settings) as builder:
        progress("measuring the T^2 memory of each model at lengths " +
                 ", ".join(map(str, settings.probe_lengths)))  # fmt: skip
        infos = describe_models(builder)
        record["models"] = {name: info.record() for name, info in infos.items()}
        measured = {name: {} for name in infos}
        for length in settings.lengths:
            cells = train_at_length(builder, infos, length, measured, progress)
            record["training"].append({
                "length": length,
                "models": {name: cell.record() for name, cell in cells.items()},
                "ratios": training_ratios(cells),
            })  # fmt: skip
            save(record)
        progress(f"decoding {max(settings.decode_lengths)} tokens, one at a time")
        record["decoding"] = decoding_record(settings, decode(builder, progress))
    record["complete"] = True
    save(record)
    return record


def _number(value: Optional[float], digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def training_table(record: dict) -> str:
    names = list(record["models"])
    others = [n for n in names if n != "global"]
    header = (
        ["T"] + [f"{n} words/s" for n in names] + [f"{n}/global" for n in others]
        + [f"{n} MiB" for n in names] + [f"{n}/global memory" for n in others]
    )  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    notes = []
    for row in record["training"]:
        models, ratios = row["models"], row["ratios"]
        cells = [str(row["length"])]
        for n in names:
            rate = models[n]["words_per_second"]
            cells.append(_number(rate) if models[n]["fits"] else "does not fit")
        cells += [_number(ratios[f"{n}/global"]["words_per_second"], 3) for n in others]
        for n in names:
            peak = models[n]["peak_bytes"]
            cells.append(_number(peak / MiB) if peak is not None else "does not fit")
        cells += [_number(ratios[f"{n}/global"]["memory"], 3) for n in others]
        lines.append("| " + " | ".join(cells) + " |")
        notes += [f"T={row['length']} {n}: does not fit: {models[n]['does_not_fit']}"
                  for n in names if not models[n]["fits"]]  # fmt: skip
    return "\n".join(lines + ([""] + notes if notes else []))


def decoding_table(record: dict) -> str:
    decoding = record["decoding"]
    names = ["global", "local", "local_full_cache"]
    header = (
        ["t"] + [f"{n} ms/token" for n in names] + ["local/global ms"]
        + [f"{n} cache KiB/layer" for n in names] + ["local/full cache", "(window+1)/t"]
    )  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for point in decoding["points"]:
        ms = [point[n]["ms_per_token"] for n in names]
        cells = [str(point["t"])] + [f"{m:.2f}" for m in ms] + [f"{ms[1] / ms[0]:.3f}"]
        cells += [_number(max(point[n]["cache_bytes_per_layer"]) / KiB, 1) for n in names]
        cells += [f"{point['local_cache_over_full']:.4f}", f"{point['window_share']:.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
    first, last = decoding["points"][0]["t"], decoding["points"][-1]["t"]
    growth = ", ".join(
        f"{n} {decoding['ms_per_token_last_over_first'][n]:.2f}x" for n in names
    )
    check = decoding["rolling_vs_full_cache"]
    verdict = "agree" if check["agree"] else "DIFFER"
    lines += [
        "",
        f"ms per token at t={last} over t={first}: {growth}",
        f"rolling vs full cache: {verdict} over {check['steps']} steps (same greedy tokens: "
        f"{'yes' if check['same_greedy_tokens'] else 'no'}, max |logit difference| "
        f"{check['max_abs_logit_difference']:.2e}, tolerance {check['tolerance']:.0e})",
    ]
    return "\n".join(lines)


def report(record: dict) -> str:
    s, m = record["settings"], record["machine"]
    mixed = f"{s['global_heads']} global + {s['heads'] - s['global_heads']} local-{s['window']}"
    title = (
        f"long context (CPU, {m['threads']} threads, torch {m['torch']}): {s['layers']} layers, "
        f"{s['dims']} dims, {s['heads']} heads, vocabulary {s['vocab_size']}; global = "
        f"fairseq's transformer_lm, local = every head local-{s['window']}, mixed = {mixed}"
    )
    training = (
        f"training: forward + backward + Adam on one sequence of T tokens; words/s: median of "
        f"{s['rounds']} alternating rounds; MiB: peak of torch's allocations from building the "
        f"model through two steps (cap {s['memory_cap_gb']:g} GiB)"
    )
    decoding = (
        f"decoding: one token at a time through fairseq's incremental state, greedy after a prompt "
        f"of {PROMPT_TOKENS} tokens; ms/token: median of the {s['timing_steps']} steps ending "
        f"at t; cache: the buffers each layer's incremental state holds (largest layer)"
    )
    return "\n\n".join(
        [title, training, training_table(record), decoding, decoding_table(record)]
    ) + "\n"
