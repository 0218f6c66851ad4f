"""The long-context run: training at every length, then decoding, and its JSON record."""

import contextlib
import datetime
import os
import platform
from typing import Callable

import fairseq
import torch

from ...cpu_allocator import loaded_allocator
from .decoding import decode, decoding_record
from .memory import describe_models
from .models import LanguageModelBuilder
from .settings import Settings, settings_record
from .training import train_at_length, training_ratios


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
        # glibc's malloc faults in fresh pages for every tensor over 32 MiB at every step,
        # tcmalloc reuses them (cpu_allocator): the malloc decides how time per token grows
        "allocator": loaded_allocator(),
        "allocator_environment": {
            name: value for name, value in os.environ.items()
            if name.startswith(("MALLOC_", "TCMALLOC_")) or name == "LD_PRELOAD"
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


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
        timed = {name: {} for name in infos}
        for length in settings.lengths:
            cells = train_at_length(builder, infos, length, measured, timed, progress)
            record["training"].append({
                "length": length,
                "models": {name: cell.record() for name, cell in cells.items()},
                "ratios": training_ratios(cells),
            })  # fmt: skip
            save(record)
        progress(f"decoding {settings.longest_decode} tokens, one at a time")
        record["decoding"] = decoding_record(settings, decode(builder, progress))
    record["complete"] = True
    save(record)
    return record
