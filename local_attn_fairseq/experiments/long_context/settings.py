"""What a long-context run measures: its sizes (the full run's and the quick one's) and the three
models it compares, all of the same sizes and parameters."""

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

GiB, MiB, KiB = 2**30, 2**20, 2**10
# The probes that measure the T^2 memory end at the longest T or here: long enough that
# constant buffers no longer blur the T^2 term, short enough to be cheap at every T.
LONGEST_PROBE = 2048

# The memory cap (GiB) is the all-local model's target at T = 65536; fairseq's transformer_lm
# is estimated at 39 there (its float causal mask, built through a temporary of its size, takes
# 8 bytes per T^2) and is reported as not fitting, with its estimate, instead of trained. The
# time cap (minutes of one model's steps at one length) keeps the whole run near an hour on a
# 2-core CPU: the models whose attention is quadratic are reported as too slow at the lengths
# where their steps would take longer (transformer_lm at T = 32768, about 30 minutes).
FULL_SIZES = dict(
    lengths=(1024, 4096, 16384, 32768, 65536), layers=6, dims=512, heads=8, global_heads=2,
    window=64, vocab_size=1000, rounds=3, decode_lengths=(512, 2048, 8192),
    rolling_decode_lengths=(65536,), timing_steps=64, memory_cap_gb=16.0, time_cap_minutes=12.0,
)  # fmt: skip
QUICK_SIZES = dict(
    FULL_SIZES, lengths=(64, 256), layers=2, dims=64, window=8, rounds=2,
    decode_lengths=(16, 64), rolling_decode_lengths=(256,), timing_steps=8,
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
    decode_lengths: Tuple[int, ...]  # ascending, all three models in lockstep
    # ascending, longer than every decode length: the rolling cache decoding on alone
    rolling_decode_lengths: Tuple[int, ...]
    timing_steps: int  # decoding steps timed up to each decode length
    memory_cap_gb: float
    time_cap_minutes: float  # of one model's steps at one training length

    @property
    def time_cap_seconds(self) -> float:
        return self.time_cap_minutes * 60

    @property
    def memory_cap_bytes(self) -> int:
        return int(self.memory_cap_gb * GiB)

    @property
    def max_positions(self) -> int:
        """Positions every model is built with: the longest training sequence, or the prompt
        and every decoded token (fairseq's generator stops at a model's positions)."""
        return max(max(self.lengths), self.longest_decode + 1)

    @property
    def longest_decode(self) -> int:
        return max(self.decode_lengths + self.rolling_decode_lengths)

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
        time_cap_seconds=settings.time_cap_seconds,
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
