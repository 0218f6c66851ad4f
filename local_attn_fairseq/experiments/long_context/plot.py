"""A long-context record drawn: training time per token and peak training memory against T for
the three models, on log axes. Measured points are filled and joined; a model not run at a
length (over the memory cap, or too slow) is drawn at its estimate, hollow, joined by a dashed
line, so that where each model stops and why is read off the figure."""

from typing import Optional

from ...analysis.output import pyplot
from ...file_safety import atomic_output
from .settings import GiB
from .training import UNTIMED_STEPS

COLOURS = {"global": "C3", "local": "C0", "mixed": "C2"}


def _cells(record: dict, name: str):
    """[(T, cell)] of one model, in the record's order (ascending T)."""
    return [(row["length"], row["models"][name]) for row in record["training"]]


def _ms_per_token(cell: dict) -> Optional[float]:
    rate = cell["words_per_second"]
    return 1e3 / rate if rate else None


def _estimated_ms_per_token(length: int, cell: dict, rounds: int) -> Optional[float]:
    seconds = cell.get("estimated_seconds")  # of all its steps, the untimed and the rounds
    return 1e3 * seconds / (UNTIMED_STEPS + rounds) / length if seconds else None


def draw(record: dict, path: str) -> str:
    """The figure of ``record`` as a PNG at ``path`` (written to a temporary name first)."""
    plt = pyplot()
    from matplotlib.ticker import FuncFormatter  # after pyplot(), which chooses the backend
    rounds = record["settings"]["rounds"]
    figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in record["models"]:
        colour = COLOURS.get(name)
        cells = _cells(record, name)
        measured = [(t, _ms_per_token(c), c["peak_bytes"] / GiB) for t, c in cells
                    if c["peak_bytes"] is not None and c["words_per_second"]]  # fmt: skip
        estimated = [(t, _estimated_ms_per_token(t, c, rounds), c["estimated_bytes"] / GiB)
                     for t, c in cells if c["peak_bytes"] is None]  # fmt: skip
        for axis, column in ((time_axis, 1), (memory_axis, 2)):
            points = [(p[0], p[column]) for p in measured]
            axis.plot(*zip(*points), "o-", color=colour, label=name)
            guessed = [(p[0], p[column]) for p in estimated if p[column] is not None]
            if guessed:
                bridge = points[-1:] + guessed
                axis.plot(*zip(*bridge), "--", color=colour, linewidth=1)
                axis.plot(*zip(*guessed), "o", color=colour, markerfacecolor="none",
                          label=f"{name}, not run: estimate")  # fmt: skip
    cap = record["settings"]["memory_cap_bytes"] / GiB
    memory_axis.axhline(cap, color="grey", linestyle=":", linewidth=1)
    memory_axis.annotate(
        f"memory cap {cap:g} GiB", (record["training"][0]["length"], cap),
        textcoords="offset points", xytext=(2, 3), fontsize=8, color="grey",
    )  # fmt: skip
    time_axis.set_ylabel("training ms per token (forward, backward, Adam)")
    memory_axis.set_ylabel("peak training memory (GiB)")
    lengths = [row["length"] for row in record["training"]]
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    for axis in (time_axis, memory_axis):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xticks(lengths, [f"{t:,}" for t in lengths], fontsize=8)
        axis.yaxis.set_major_formatter(plain)
        axis.yaxis.set_minor_formatter(plain)
        axis.tick_params(axis="y", which="both", labelsize=7)
        axis.set_xlabel("sequence length T (tokens)")
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=7)
    s, machine = record["settings"], record["machine"]
    figure.suptitle(
        f"{s['layers']} layers, {s['dims']} dims, {s['heads']} heads: fairseq's transformer_lm "
        f"(global), every head local-{s['window']} (local), {s['global_heads']} global heads "
        f"a layer (mixed); CPU, {machine['threads']} threads, "
        f"{machine.get('allocator', 'glibc')}'s malloc",
        fontsize=9,
    )
    figure.tight_layout()
    with atomic_output(path) as temporary:
        figure.savefig(temporary, format="png", dpi=100)
    plt.close(figure)
    return path
