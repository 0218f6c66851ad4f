"""``local-attn-analyze sensitivity``: gamma_local / gamma_syntactic / gamma_unrelated per
encoder layer (Pande et al. 2021, Section 3.1 and Figure 1).

Writes ``sensitivity.json`` (per layer: mean, median and every sentence's gamma of each token
set) and ``sensitivity.png`` (their distributions, one group of boxes per layer) and prints a
table of the means. Without ``--conllu``/``--spacy-model`` syntactic relations are unknown: only
local and non-local tokens are compared.
"""

from typing import Dict, List

from .dependencies import TokenSetSentences
from .loading import add_common_arguments, attention_inputs
from .output import SET_COLOURS, format_table, mean, median, pyplot, save_figure, write_json
from .sensitivity import gammas, jacobian_norms

HELP = "sensitivity of encoder self-attention outputs to local, syntactic and unrelated inputs"
NO_SYNTAX_NOTE = (
    "no --conllu or --spacy-model: syntactic relations unknown, so tokens are only local "
    "(|i-j| <= 2) or non-local"
)


def add_arguments(parser):
    add_common_arguments(parser, max_sentences=100)


def run(args):
    sentences = TokenSetSentences(args)
    per_layer: Dict[int, Dict[str, List[float]]] = {layer: {} for _, layer in sentences.modules}
    for sentence, positions, sets in sentences:
        calls = attention_inputs(sentences.loaded.model, sentence.sample)
        for (_, layer), module in sentences.modules.items():
            beta = jacobian_norms(module, calls[("encoder_self", layer)])
            beta = beta[positions][:, positions]
            for name, value in gammas(beta, sets).items():
                per_layer[layer].setdefault(name, [])
                if value is not None:
                    per_layer[layer][name].append(value)
    result = summarise(args, per_layer, sentences.count, sentences.syntax)
    write_json(args.output_dir, "sensitivity.json", result)
    plot(result, args.output_dir)
    print(table(result))
    if sentences.syntax is None:
        print(NO_SYNTAX_NOTE)
    print(f"wrote {args.output_dir}/sensitivity.json and sensitivity.png")
    return 0


def summarise(args, per_layer, sentences, syntax) -> dict:
    layers = []
    for layer, sets in sorted(per_layer.items()):
        layers.append(
            {
                "layer": layer,
                "mean": {name: mean(values) for name, values in sets.items()},
                "median": {name: median(values) for name, values in sets.items()},
                "per_sentence": sets,
            }
        )
    set_names = list(per_layer[min(per_layer)].keys())
    return {
        "checkpoint": args.path,
        "sentences": sentences,
        "sets": set_names,
        "definition": "beta[i,j] = ||dY[i]/dX[j]||_F of each encoder self-attention module; "
        "gamma_A = avg_i avg_{j in A_i} beta[i,j]; local A_i = [i-2, i+2] (i included); "
        "the end-of-sentence symbol is left out",
        "syntax": None if syntax is None else syntax.summary(),
        "note": NO_SYNTAX_NOTE if syntax is None else None,
        "layers": layers,
    }


def table(result) -> str:
    names = result["sets"]
    rows = []
    for entry in result["layers"]:
        means = [entry["mean"][name] for name in names]
        local, last = means[0], means[-1]
        ratio = local / last if local is not None and last else None
        rows.append([entry["layer"], *means, ratio])
    headers = ["layer", *[f"gamma_{n}" for n in names], f"local/{names[-1]}"]
    return f"sensitivity over {result['sentences']} sentences (mean per layer)\n" + format_table(
        headers, rows
    )


def plot(result, output_dir):
    plt = pyplot()
    names = result["sets"]
    layers = result["layers"]
    figure, axes = plt.subplots(figsize=(1.2 + 0.9 * len(layers) * len(names) / 2, 3.2))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        data = [entry["per_sentence"][name] or [float("nan")] for entry in layers]
        centres = [i + (k - (len(names) - 1) / 2) * width for i in range(len(layers))]
        boxes = axes.boxplot(
            data,
            positions=centres,
            widths=width * 0.9,
            patch_artist=True,
            showfliers=False,
            medianprops={"color": "black"},
        )
        for box in boxes["boxes"]:
            box.set_facecolor(SET_COLOURS.get(name, "tab:purple"))
        axes.plot([], [], color=SET_COLOURS.get(name, "tab:purple"), lw=6, label=name)
    axes.set_xticks(range(len(layers)))
    axes.set_xticklabels([str(entry["layer"]) for entry in layers])
    axes.set_xlabel("encoder layer (0-based)")
    axes.set_ylabel("gamma (mean ||dY[i]/dX[j]||)")
    axes.set_title(f"Sensitivity, {result['sentences']} sentences")
    axes.legend(fontsize="small")
    save_figure(figure, output_dir, "sensitivity.png")
