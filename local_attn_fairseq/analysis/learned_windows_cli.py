"""``local-attn-analyze windows``: the windows learned by Gaussian localness heads (Yang et al.
2018, Figures 2-3) and by dynamic-window heads (Nguyen et al. 2020), per layer and head.

Writes ``windows.json`` (per mechanism and layer: mean, quartiles and per-head means of the
window size, of the centre/boundary offsets from the query and of the centre's distance from
it), ``windows_gaussian.png`` and/or
``windows_dynamic.png`` (window size distribution per layer; per-head mean windows, or the
boundary offsets) and prints a table. Decoder layers need target sentences (``--data`` or
``--target-text``) to be read.
"""

import torch

from .learned_windows import (
    WindowStatistics,
    dynamic_window_modules,
    dynamic_windows,
    gaussian_attention_modules,
    gaussian_windows,
)
from .loading import AnalysisInputError, add_common_arguments, load_model, read_sentences
from .output import format_table, pyplot, save_figure, write_json

HELP = (
    "windows learned by Gaussian localness (Yang et al.) and dynamic-window (Nguyen et al.) heads"
)
QUANTITIES = {
    "gaussian": ("window", "offset", "distance"),
    "dynamic": ("size", "left_offset", "right_offset"),
}
SIZE = {"gaussian": "window", "dynamic": "size"}
TYPE_LABELS = {"encoder_self": "enc", "decoder_self": "dec", "decoder_cross": "cross"}
NO_MECHANISM = (
    "{path}: the model has neither Gaussian localness heads (Yang et al.) nor dynamic windows "
    "(Nguyen et al.), so it learned no windows; such models come from --arch "
    "transformer_localness* / transformer_dynwin*, or --locality-config heads with "
    "'gaussian', 'mw' or 'aw'"
)


def add_arguments(parser):
    add_common_arguments(parser, max_sentences=100)


def run(args):
    loaded = load_model(args.path, args.data, cpu=args.cpu)
    model = loaded.model
    mechanisms = {
        "gaussian": bool(gaussian_attention_modules(model)),
        "dynamic": bool(dynamic_window_modules(model)),
    }
    if not any(mechanisms.values()):
        raise AnalysisInputError(NO_MECHANISM.format(path=args.path))
    statistics = WindowStatistics()
    sentences = 0
    for sentence in read_sentences(loaded, args):
        sentences += 1
        if mechanisms["gaussian"]:
            for key, read in gaussian_windows(model, sentence.sample).items():
                statistics.add("gaussian", key, read, QUANTITIES["gaussian"])
        if mechanisms["dynamic"]:
            for key, read in dynamic_windows(model, sentence.sample).items():
                statistics.add("dynamic", key, read, QUANTITIES["dynamic"])
    result = summarise(args, statistics, sentences)
    written = [
        plot(name, layers, sentences, args.output_dir)
        for name, layers in result["mechanisms"].items()
    ]
    for layers in result["mechanisms"].values():
        for entry in layers:
            for quantity in QUANTITIES["gaussian"] + QUANTITIES["dynamic"]:
                if quantity in entry:
                    del entry[quantity]["values"]  # plotted; too many for the JSON file
    written.insert(0, write_json(args.output_dir, "windows.json", result))
    print(table(result))
    print(f"wrote {', '.join(written)}")
    return 0


def describe(values):
    if not values:
        return None
    data = torch.tensor(values, dtype=torch.float64)
    q1, q2, q3 = torch.quantile(data, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
    return {
        "mean": float(data.mean()),
        "q1": float(q1),
        "median": float(q2),
        "q3": float(q3),
        "count": len(values),
    }


def summarise(args, statistics: WindowStatistics, sentences: int) -> dict:
    mechanisms = {"gaussian": [], "dynamic": []}
    for (mechanism, key), heads in sorted(statistics.heads.items(), key=_order):
        entry = {"attention": key[0], "layer": key[1], "heads": heads}
        for quantity in QUANTITIES[mechanism]:
            per_head = statistics.values.get((mechanism, key, quantity))
            if per_head is None:
                continue
            pooled = [v for values in per_head for v in values]
            entry[quantity] = describe(pooled)
            entry[quantity]["per_head_mean"] = [
                sum(values) / len(values) if values else None for values in per_head
            ]
            entry[quantity]["values"] = pooled
        mechanisms[mechanism].append(entry)
    return {
        "checkpoint": args.path,
        "sentences": sentences,
        "definition": "gaussian: window D, centre offset P - i and distance |P - i| per query "
        "(Yang et al.); "
        "dynamic: size E|r - l| + 1 and boundary offsets E[l] - i, E[r] - i of the pointer "
        "softmaxes per query (Nguyen et al.)",
        "mechanisms": {name: layers for name, layers in mechanisms.items() if layers},
    }


def _order(item):
    (mechanism, (kind, layer)), _ = item
    return mechanism, list(TYPE_LABELS).index(kind), layer


def label(entry) -> str:
    return f"{TYPE_LABELS[entry['attention']]}{entry['layer']}"


def table(result) -> str:
    rows = []
    for mechanism, layers in result["mechanisms"].items():
        for entry in layers:
            size = entry[SIZE[mechanism]]
            offsets = [
                entry[q]["mean"] if q in entry else None
                for q in ("offset", "distance", "left_offset", "right_offset")
            ]
            rows.append(
                [mechanism, label(entry), len(entry["heads"]), size["mean"], size["median"]]
                + offsets
            )
    headers = [
        "mechanism", "layer", "heads", "mean size", "median", "centre-i", "|centre-i|", "l-i",
        "r-i",
    ]  # fmt: skip
    return f"learned windows over {result['sentences']} sentences\n" + format_table(headers, rows)


def plot(mechanism: str, layers, sentences: int, output_dir: str) -> str:
    plt = pyplot()
    figure, (sizes, detail) = plt.subplots(1, 2, figsize=(2.2 + 1.1 * len(layers), 3.2))
    names = [label(entry) for entry in layers]
    size = SIZE[mechanism]
    sizes.boxplot(
        [entry[size]["values"] for entry in layers],
        showfliers=False,
        medianprops={"color": "black"},
    )
    sizes.set_xticks(range(1, len(layers) + 1))
    sizes.set_xticklabels(names)
    sizes.set_ylabel("window size (tokens)")
    sizes.set_title("window size per query", fontsize="small")
    if mechanism == "gaussian":
        for x, entry in enumerate(layers, start=1):
            means = entry[size]["per_head_mean"]
            detail.scatter([x] * len(means), means, c=range(len(means)), cmap="tab10", s=18)
        detail.set_ylabel("mean window D per head")
        detail.set_title("heads (colour: head)", fontsize="small")
    else:
        for k, (quantity, colour) in enumerate(
            (("left_offset", "tab:blue"), ("right_offset", "tab:red"))
        ):
            present = [(x, e[quantity]["values"]) for x, e in enumerate(layers, 1) if quantity in e]
            if not present:
                continue
            boxes = detail.boxplot(
                [values for _, values in present],
                positions=[x + (k - 0.5) * 0.35 for x, _ in present],
                widths=0.3,
                patch_artist=True,
                showfliers=False,
                medianprops={"color": "black"},
            )
            for box in boxes["boxes"]:
                box.set_facecolor(colour)
            detail.plot([], [], color=colour, lw=6, label=quantity.replace("_offset", " - i"))
        detail.axhline(0, color="gray", lw=0.5)
        detail.set_ylabel("expected boundary - query position")
        detail.legend(fontsize="x-small")
    detail.set_xticks(range(1, len(layers) + 1))
    detail.set_xticklabels(names)
    title = {"gaussian": "Gaussian localness", "dynamic": "Dynamic windows"}[mechanism]
    figure.suptitle(f"{title}, {sentences} sentences", fontsize="medium")
    return save_figure(figure, output_dir, f"windows_{mechanism}.png")
