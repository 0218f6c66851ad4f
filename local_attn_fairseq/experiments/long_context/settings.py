"""What a long-context run measures: its sizes (the full run's and the quick one's) and the three
models it compares, all of the same sizes and parameters."""

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

GiB, MiB, KiB = 2**30, 2**20, 2**10
# The probes that measure the T^2 memory end at the longest T or here: long enough that
# constant buffers no longer blur the T^2 term, short enough to be cheap at every T.
LONGEST_PROBE = 2048

# The cap (GiB) lies between the all-local model at T = 65536 (estimated at 7.9 from the
# measurements of benchmarks/results/long_context_cpu.json without the (T, T) mask) and fairseq's
# transformer_lm at T = 32768 (11.8: its float causal mask, built through a temporary of its
# size, takes 8 bytes per T^2), so that the global model is reported there as not fitting, with
# its estimate, instead of trained; on a 24 GiB machine it leaves room for another job.
FULL_SIZES = dict(
    lengths=(1024, 4096, 16384, 32768, 65536), layers=6, dims=512, heads=8, global_heads=2,
    window=64, vocab_size=1000, rounds=3, decode_lengths=(512, 2048, 8192), timing_steps=64,
    memory_cap_gb=10.0,
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


def settings_record(settings: Settings) -> dict:
    """The settings as the record holds them, with the sizes they imply."""
    record = dict(vars(settings))
    record.update(
        ffn_dims=4 * settings.dims,
        memory_cap_bytes=settings.memory_cap_bytes,
        probe_lengths=settings.probe_lengths,
        max_positions=settings.max_positions,
    )
    return record


@dataclass(frozen=True)
class Contender:
    name: str
    arch: str
    locality_config: Optional[str] = None


def decoder_spec(heads: Sequence[str]) -> str:
    """A locality spec giving every decoder layer these heads."""
    return "{decoder_self: {all: [" + ", ".join(heads) + "]}}"


def contenders(settings: Settings) -> Tuple[Contender, ...]:
    """fairseq's transformer_lm, every head local, and mixed layers, in that order."""
    local = f"local-{settings.window}"
    mixed = ["global"] * settings.global_heads + [local] * (settings.heads - settings.global_heads)
    return (
        Contender("global", "transformer_lm"),
        Contender("local", "transformer_lm_local", decoder_spec([local] * settings.heads)),
        Contender("mixed", "transformer_lm_local", decoder_spec(mixed)),
    )
