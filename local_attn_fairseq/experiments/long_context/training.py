"""Training at one length T: seconds of one step (forward, backward, Adam) on one sequence of T
tokens, the three models alternating in rounds within one process
(``measurement.alternating_rounds``), words/s from the median; beside it each model's memory
(``memory``). A model whose estimated memory exceeds the cap, or that runs out of memory, is
reported as not fitting instead of ending the run; one whose steps at T are estimated to take
longer than the time cap, from its own step times at shorter lengths, is reported as too slow
and not run."""

import gc
import statistics
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from ..measurement import alternating_rounds
from .memory import ModelInfo, measured_trainer
from .models import LanguageModelBuilder
from .settings import GiB, MiB

UNTIMED_STEPS = 2  # memory.trained_twice's, which also warm up


@dataclass
class TrainingCell:
    """One model at one length."""

    contender: str
    length: int
    estimated_bytes: float
    peak_bytes: Optional[int] = None
    estimated_seconds: Optional[float] = None  # of its steps, from its shorter lengths
    step_seconds: List[float] = field(default_factory=list)
    does_not_fit: str = ""  # why, when it does not
    too_slow: str = ""  # why it was not run, when its steps would exceed the time cap

    @property
    def measured(self) -> bool:
        return not (self.does_not_fit or self.too_slow)

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
            "too_slow": self.too_slow or None,
            "words_per_second": self.words_per_second,
            "words_per_second_rounds": rates,
            "peak_bytes": self.peak_bytes,
            "estimated_bytes": round(self.estimated_bytes),
            "estimated_seconds": self.estimated_seconds,
        }


def estimated_step_seconds(length: int, timed: Dict[int, float]) -> Optional[float]:
    """Seconds of one training step at ``length`` from the model's median step seconds at
    shorter lengths (``timed``: length -> seconds): the time per token grows linearly in T (the
    T^2 attention of a global head; flat for a local one), along the line through the two
    longest shorter lengths (never falling), constant with one, None without."""
    points = sorted((t, s / t) for t, s in timed.items() if t < length)[-2:]
    if not points:
        return None
    per_token = points[-1][1]
    if len(points) == 2:
        (t1, p1), (t2, p2) = points
        per_token = p2 + max(0.0, (p2 - p1) / (t2 - t1)) * (length - t2)
    return per_token * length


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def training_ratios(cells: Dict[str, TrainingCell]) -> dict:
    """Each model's words/s and memory over the global model's."""
    base = cells["global"]
    return {
        f"{name}/global": {
            "words_per_second": _ratio(cell.words_per_second, base.words_per_second),
            "memory": _ratio(cell.peak_bytes, base.peak_bytes),
        }
        for name, cell in cells.items()
        if name != "global"
    }


def train_at_length(
    builder: LanguageModelBuilder,
    infos: Dict[str, ModelInfo],
    length: int,
    measured: Dict[str, Dict[int, int]],
    timed: Dict[str, Dict[int, float]],
    progress: Callable[[str], None],
) -> Dict[str, TrainingCell]:
    """Every model at one length: the fit and time checks, the memory (with two untimed steps
    that also warm up), then the timed rounds of those measured. ``measured`` (model -> length
    -> peak bytes) and ``timed`` (model -> length -> median seconds a step) hold the shorter
    lengths' for the estimates and gain this one's."""
    settings = builder.settings
    steps = UNTIMED_STEPS + settings.rounds
    cells, trainers = {}, {}
    for name, info in infos.items():
        estimate = info.estimated_bytes(length, measured[name])
        cell = cells[name] = TrainingCell(name, length, estimate)
        step_seconds = estimated_step_seconds(length, timed[name])
        if step_seconds is not None:
            cell.estimated_seconds = steps * step_seconds
        if estimate > settings.memory_cap_bytes:
            cell.does_not_fit = (
                f"estimated {estimate / GiB:.2f} GiB > cap {settings.memory_cap_gb:g} GiB"
            )
        elif cell.estimated_seconds is not None and (
            cell.estimated_seconds > settings.time_cap_seconds
        ):
            cell.too_slow = (
                f"estimated {cell.estimated_seconds / 60:.1f} min for {steps} steps > time cap "
                f"{settings.time_cap_minutes:g} min (estimated {estimate / GiB:.2f} GiB)"
            )
            progress(f"T={length} {name}: too slow, not run ({cell.too_slow})")
            continue
        else:
            progress(f"T={length} {name}: building, two untimed steps (memory)")
            trainer, peak, cell.does_not_fit = measured_trainer(builder, info.contender, length)
        if cell.does_not_fit:
            progress(f"T={length} {name}: does not fit ({cell.does_not_fit})")
            continue
        cell.peak_bytes = measured[name][length] = peak
        trainers[name] = trainer
        progress(f"T={length} {name}: {peak / MiB:.0f} MiB (estimated {estimate / MiB:.0f})")

    def timed_step(name):
        def step():
            seconds = trainers[name].step()
            progress(f"T={length} {name}: {seconds:.2f} s/step, {length / seconds:.0f} words/s")
            return seconds

        return step

    rounds = alternating_rounds({name: timed_step(name) for name in trainers}, settings.rounds)
    for name, seconds in rounds.items():
        cells[name].step_seconds = seconds
        timed[name][length] = statistics.median(seconds)
    trainers.clear()
    gc.collect()
    return cells
