"""A long-context record as markdown: a title, the training table (words/s and peak memory of
each model at each T, their ratios to the global model) and the decoding table."""

from typing import Optional

from ...file_safety import read_json
from .decoding import PROMPT_TOKENS
from .settings import KiB, MiB


def _number(value: Optional[float], digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _table_head(header) -> list:
    return ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]


def _measured(model: dict) -> bool:
    return model["fits"] and not model.get("too_slow")  # records before the time cap have none


def _not_measured(model: dict) -> str:
    return "does not fit" if not model["fits"] else "too slow"


def training_table(record: dict) -> str:
    names = list(record["models"])
    others = [n for n in names if n != "global"]
    header = (
        ["T"] + [f"{n} words/s" for n in names] + [f"{n}/global" for n in others]
        + [f"{n} MiB" for n in names] + [f"{n}/global memory" for n in others]
    )  # fmt: skip
    lines = _table_head(header)
    notes = []
    for row in record["training"]:
        models, ratios = row["models"], row["ratios"]
        cells = [str(row["length"])]
        for n in names:
            cells.append(_number(models[n]["words_per_second"]) if _measured(models[n])
                         else _not_measured(models[n]))  # fmt: skip
        cells += [_number(ratios[f"{n}/global"]["words_per_second"], 3) for n in others]
        for n in names:
            peak, estimate = models[n]["peak_bytes"], models[n]["estimated_bytes"]
            cells.append(_number(peak / MiB) if peak is not None else
                         f"{_not_measured(models[n])} (est. {estimate / MiB:,.0f})")  # fmt: skip
        cells += [_number(ratios[f"{n}/global"]["memory"], 3) for n in others]
        lines.append("| " + " | ".join(cells) + " |")
        notes += [f"T={row['length']} {n}: {_not_measured(models[n])}: "
                  f"{models[n]['does_not_fit'] or models[n].get('too_slow')}"
                  for n in names if not _measured(models[n])]  # fmt: skip
    return "\n".join(lines + ([""] + notes if notes else []))


def decoding_table(record: dict) -> str:
    decoding = record["decoding"]
    names = ["global", "local", "local_full_cache"]
    header = (
        ["t"] + [f"{n} ms/token" for n in names] + ["local/global ms"]
        + [f"{n} cache KiB/layer" for n in names] + ["local/full cache", "(window+1)/t"]
    )  # fmt: skip
    lines = _table_head(header)
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
    return "\n".join(lines + rolling_cache_alone_table(decoding))


def rolling_cache_alone_table(decoding: dict) -> list:
    points = decoding.get("rolling_cache_alone")  # records before it have none
    if not points:
        return []
    reference = points[0]["reference_t"]
    header = ["t", "local ms/token", f"beside it at t={reference}", f"t over t={reference}",
              "cache KiB/layer"]  # fmt: skip
    lines = ["", "the rolling cache decoding on alone, timed beside a fresh one:", ""]
    lines += _table_head(header)
    for point in points:
        cells = [str(point["t"]), f"{point['ms_per_token']:.2f}",
                 f"{point['reference_ms_per_token']:.2f}",
                 f"{point['ms_per_token_over_reference']:.3f}",
                 _number(max(point["cache_bytes_per_layer"]) / KiB, 1)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def report(record: dict) -> str:
    s, m = record["settings"], record["machine"]
    mixed = f"{s['global_heads']} global + {s['heads'] - s['global_heads']} local-{s['window']}"
    title = (
        f"long context (CPU, {m['threads']} threads, torch {m['torch']}, "
        f"{m.get('allocator', 'glibc')}'s malloc): {s['layers']} layers, "
        f"{s['dims']} dims, {s['heads']} heads, vocabulary {s['vocab_size']}; global = "
        f"fairseq's transformer_lm, local = every head local-{s['window']}, mixed = {mixed}"
    )
    training = (
        f"training: forward + backward + Adam on one sequence of T tokens; words/s: median of "
        f"{s['rounds']} alternating rounds; MiB: peak of torch's allocations from building the "
        f"model through two steps (cap {s['memory_cap_gb']:g} GiB"
        + (f"; time cap {s['time_cap_seconds'] / 60:g} min of one model's steps at one T)"
           if "time_cap_seconds" in s else ")")
    )
    decoding = (
        f"decoding: one token at a time through fairseq's incremental state, greedy after a prompt "
        f"of {PROMPT_TOKENS} tokens; ms/token: median of the {s['timing_steps']} steps ending "
        f"at t; cache: the buffers each layer's incremental state holds (largest layer)"
    )
    parts = [title, training, training_table(record)]
    if record.get("decoding"):  # a run cut short during training has none yet
        parts += [decoding, decoding_table(record)]
    return "\n\n".join(parts) + "\n"


class NotARecord(ValueError):
    """A file that is not a long-context record; the message names the file and the fault."""


def read_record(path: str) -> dict:
    """The record of a run (``benchmarks/long_context.py --output``), checked enough to report:
    a record cut short (no decoding yet) is reported as far as it goes."""
    record = read_json(path, NotARecord)
    if not isinstance(record, dict) or record.get("benchmark") != "long_context":
        raise NotARecord(f"{path}: not a record of benchmarks/long_context.py")
    missing = [key for key in ("machine", "settings", "models", "training") if key not in record]
    if missing:
        raise NotARecord(f"{path}: lacks {', '.join(missing)}")
    return record
