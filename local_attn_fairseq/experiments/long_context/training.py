"""Training at one length T: seconds of one step (forward, backward, Adam) on one sequence of T
tokens, the three models alternating in rounds within one process
(``measurement.alternating_rounds``), words/s from the median; beside it each model's memory
(``memory``). A model whose estimated memory exceeds the cap, or that runs out of memory, is
reported as not fitting instead of ending the run."""

import gc
import statistics
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from ..measurement import alternating_rounds
from .memory import ModelInfo, measured_trainer
from .models import LanguageModelBuilder
from .settings import GiB, MiB


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
    progress: Callable[[str], None],
) -> Dict[str, TrainingCell]:
    """Every model at one length: the fit check, the memory (with two untimed steps that
    also warm up), then the timed rounds of those that fit. ``measured`` (model -> length ->
    peak bytes) holds the shorter lengths' memory for the estimate and gains this one's."""
    settings = builder.settings
    cells, trainers = {}, {}
    for name, info in infos.items():
        estimate = info.estimated_bytes(length, measured[name])
        cell = cells[name] = TrainingCell(name, length, estimate)
        if estimate > settings.memory_cap_bytes:
            cell.does_not_fit = (
                f"estimated {estimate / GiB:.2f} GiB > cap {settings.memory_cap_gb:g} GiB"
            )
        else:
            progress(f"T={length} {name}: building, two untimed steps (memory)")
            trainer, peak, cell.does_not_fit = measured_trainer(builder, info.contender, length)
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
