"""``local-attn-analyze bias``: locality and non-local syntactic attention bias of every encoder
self-attention head (Pande et al. 2021, Eq. 8, Figures 2 and 3).

Writes ``bias.json`` (every head's scores, the fraction of heads above each threshold 1..5 and
the head map at threshold 3), ``bias_thresholds.png`` (Figure 2) and ``bias_heads.png``
(Figure 3: layer x head, blue local > 3, orange syntactic > 3, purple both) and prints the
scores. Without ``--conllu``/``--spacy-model`` only the locality bias is computed.
"""

from .attention_bias import MAP_THRESHOLD, THRESHOLDS, BiasScores, fraction_above, sentence_bias
from .dependencies import TokenSetSentences
from .loading import add_common_arguments, attention_weights, head_numbers
from .output import SET_COLOURS, format_table, pyplot, save_figure, write_json

HELP = "attention bias of encoder heads towards local and syntactically related tokens (Eq. 8)"
NO_SYNTAX_NOTE = (
    "no --conllu or --spacy-model: only the locality bias is computed (syntactic relations "
    "unknown)"
)
BIAS_SETS = ("local", "syntactic")


def add_arguments(parser):
    add_common_arguments(parser, max_sentences=1000)


def run(args):
    sentences = TokenSetSentences(args)
    model = sentences.loaded.model
    accumulated = BiasScores()
    for sentence, positions, sets in sentences:
        weights = attention_weights(model, sentence.sample, types=("encoder_self",))
        for (kind, layer), head_weights in weights.items():
            head_weights = head_weights[:, positions][:, :, positions]
            for name in BIAS_SETS:
                if name in sets:
                    accumulated.add(layer, name, *sentence_bias(head_weights, sets[name]))
    syntax = sentences.syntax
    names = [n for n in BIAS_SETS if syntax is not None or n == "local"]
    result = summarise(args, sentences.modules, accumulated, names, sentences.count, syntax)
    write_json(args.output_dir, "bias.json", result)
    plot_thresholds(result, args.output_dir)
    plot_head_map(result, args.output_dir)
    print(report(result))
    if syntax is None:
        print(NO_SYNTAX_NOTE)
    print(f"wrote {args.output_dir}/bias.json, bias_thresholds.png and bias_heads.png")
    return 0


def summarise(args, modules, accumulated, names, sentences, syntax) -> dict:
    layers = []
    for (_, layer), module in modules.items():
        entry = {"layer": layer, "heads": head_numbers(module)}
        for name in names:
            entry[name] = accumulated.scores(layer, name)
        layers.append(entry)
    every = {name: [s for entry in layers for s in entry[name]] for name in names}
    return {
        "checkpoint": args.path,
        "sentences": sentences,
        "definition": "Eq. 8: (mean weight on A_i) / (mean weight on the sentence), averaged "
        "over tokens i, then over sentences; local A_i = [i-2, i+2], syntactic A_i = related "
        "and not local; the end-of-sentence symbol is left out",
        "sets": names,
        "syntax": None if syntax is None else syntax.summary(),
        "note": NO_SYNTAX_NOTE if syntax is None else None,
        "layers": layers,
        "fraction_above": {
            name: {str(t): fraction_above(every[name], t) for t in THRESHOLDS} for name in names
        },
        "map_threshold": MAP_THRESHOLD,
        "heads_above_map_threshold": {
            name: [
                [entry["layer"], head]
                for entry in layers
                for head, score in zip(entry["heads"], entry[name])
                if score is not None and score > MAP_THRESHOLD
            ]
            for name in names
        },
    }


def head_count(layers) -> int:
    """Columns for the heads' unpruned numbers."""
    return 1 + max((max(entry["heads"], default=-1) for entry in layers), default=-1)


def report(result) -> str:
    width = head_count(result["layers"])
    parts = []
    for name in result["sets"]:
        rows = []
        for entry in result["layers"]:
            scores = dict(zip(entry["heads"], entry[name]))
            rows.append([entry["layer"], *[scores.get(h, "pruned") for h in range(width)]])
        parts.append(f"{name} bias per head, {result['sentences']} sentences")
        parts.append(format_table(["layer", *[f"h{h}" for h in range(width)]], rows))
    rows = [
        [f"> {t}", *[result["fraction_above"][n][str(t)] for n in result["sets"]]]
        for t in THRESHOLDS
    ]
    parts.append("fraction of heads with bias above the threshold")
    parts.append(format_table(["threshold", *result["sets"]], rows))
    return "\n".join(parts)


def plot_thresholds(result, output_dir):
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(4, 3))
    names = result["sets"]
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        fractions = [result["fraction_above"][name][str(t)] for t in THRESHOLDS]
        offsets = [t + (k - (len(names) - 1) / 2) * width for t in THRESHOLDS]
        axes.bar(offsets, fractions, width, color=SET_COLOURS[name], label=name)
    axes.set_xticks(THRESHOLDS)
    axes.set_xlabel("threshold")
    axes.set_ylabel("fraction of heads above")
    axes.set_ylim(0, 1)
    axes.set_title(f"Attention bias, {result['sentences']} sentences")
    axes.legend(fontsize="small")
    save_figure(figure, output_dir, "bias_thresholds.png")


def plot_head_map(result, output_dir):
    from matplotlib.colors import ListedColormap

    plt = pyplot()
    layers = result["layers"]
    width = head_count(layers)
    grid = [[0] * width for _ in layers]
    above = result["heads_above_map_threshold"]
    for code, name in ((1, "local"), (2, "syntactic")):
        for layer, head in above.get(name, []):
            row = [e["layer"] for e in layers].index(layer)
            grid[row][head] += code
    colours = ListedColormap(["white", "tab:blue", "tab:orange", "tab:purple"])
    figure, axes = plt.subplots(figsize=(0.45 * width + 1.4, 0.4 * len(layers) + 1.0))
    axes.imshow(grid, cmap=colours, vmin=0, vmax=3, aspect="equal")
    for row, entry in enumerate(layers):
        for head, score in zip(entry["heads"], entry["local"]):
            if score is not None:
                axes.text(head, row, f"{score:.1f}", ha="center", va="center", fontsize=6)
    axes.set_xticks(range(width))
    axes.set_yticks(range(len(layers)))
    axes.set_yticklabels([str(entry["layer"]) for entry in layers])
    axes.set_xlabel("head")
    axes.set_ylabel("encoder layer")
    for name, colour in (
        ("local", "tab:blue"),
        ("syntactic", "tab:orange"),
        ("both", "tab:purple"),
    ):
        if name == "local" or "syntactic" in result["sets"]:
            axes.plot([], [], "s", color=colour, label=f"{name} > {result['map_threshold']}")
    axes.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes.set_title("heads with bias > 3 (numbers: locality bias)", fontsize="small")
    save_figure(figure, output_dir, "bias_heads.png")
