"""``local-attn-analyze heads``: confidence, LRP relevance and roles of attention heads
(Voita et al. 2019, Sections 4-5, Figures 1-2).

    local-attn-analyze heads --path checkpoint_best.pt --data data-bin --gen-subset valid \\
        [--conllu valid.de.conllu] [--attention-type encoder_self decoder_cross] --output-dir out

Writes, in --output-dir, ``heads.json`` (per attention type, layer and head: relevance,
confidence, the most frequent relative position of its choices, its rare-words and
dependency-relation accuracies, its roles; the positional baselines of the relations) and
``heads.png`` (per attention type: heads of each layer sorted by relevance; relevance,
confidence and roles, as Voita et al.'s Figure 1), and prints a table of every head.
Relevance needs target sentences (teacher forcing on the reference); syntactic roles need
``--conllu`` or ``--spacy-model`` and concern encoder self-attention. See ``head_roles.py`` for
the definitions and ``lrp.py`` for the relevance rules.
"""

import logging
from typing import Dict

import numpy as np

from ..cli_types import non_negative_int, positive_int
from .dependencies import SourceSyntax
from .head_roles import ROLES, HeadStatistics, Thresholds, role_label
from .loading import (
    ATTENTION_TYPES,
    AnalysisInputError,
    add_common_arguments,
    attention_modules,
    float_between,
    head_numbers,
    load_model,
    read_sentences,
)
from .lrp import RULES, HeadRelevance, Rule, attention_weights, propagate_relevance, record_forward
from .output import format_table, pyplot, save_figure, write_json

logger = logging.getLogger(__name__)

HELP = "confidence, LRP relevance and roles (positional, syntactic, rare words) of heads"
# Voita et al.'s colours: positional purple, syntactic green, rare words orange.
ROLE_COLOURS = {"positional": "#8e44ad", "syntactic": "#27ae60", "rare words": "#e67e22"}
NO_ROLE_COLOUR = "#d5d8dc"
# the shares and margins lie in [0, 1] (head_roles.Thresholds): refused with the option's name
SHARE = float_between(0.0, 1.0)
# option -> (the field of head_roles.Thresholds it sets, and whose default it takes; its type;
# help)
THRESHOLD_OPTIONS = {
    "--positional-threshold": ("positional", SHARE, "least share of a head's choices at one "
                               "relative position for the positional role, in [0, 1]"),
    "--syntactic-margin": ("syntactic_margin", SHARE, "least accuracy above the positional "
                           "baseline for the syntactic role, in [0, 1]"),
    "--min-relation-queries": ("min_relation_queries", positive_int, "least number of query "
                               "tokens in a relation for its accuracy to count (at least 1)"),
    "--rare-threshold": ("rare", SHARE, "least share of choices on the sentence's rarest token "
                         "for the rare-words role, in [0, 1]"),
    "--rare-top-n": ("rare_top_n", non_negative_int, "sentences whose rarest token is among the "
                     "N most frequent are left out of the rare-words measure (0: none)"),
}  # fmt: skip


def add_arguments(parser):
    add_common_arguments(parser, max_sentences=100)
    group = parser.add_argument_group("heads")
    group.add_argument(
        "--attention-type",
        nargs="+",
        choices=ATTENTION_TYPES,
        default=["encoder_self"],
        help="which attention to analyse (default: encoder_self, the paper's focus)",
    )
    group.add_argument(
        "--lrp-rule",
        choices=RULES,
        default=Rule.name,
        help="how relevance is shared among contributions: alpha-beta (positive and negative "
        "contributions separately, stable) or ratio (Ding et al.'s signed weight ratio)",
    )
    group.add_argument(
        "--lrp-alpha",
        default=Rule.alpha,
        type=SHARE,
        help="alpha-beta: the part of the relevance shared by positive contributions, in [0, 1]",
    )
    group.add_argument(
        "--no-relevance", action="store_true", help="skip LRP (faster: confidence and roles)"
    )
    defaults = Thresholds()
    for option, (field, parse, text) in THRESHOLD_OPTIONS.items():
        group.add_argument(option, type=parse, default=getattr(defaults, field), help=text)


def run(args):
    try:
        thresholds = Thresholds(
            args.positional_threshold,
            args.syntactic_margin,
            args.min_relation_queries,
            args.rare_threshold,
            args.rare_top_n,
        )
        rule = Rule(args.lrp_rule, args.lrp_alpha)
    except ValueError as error:
        raise AnalysisInputError(str(error)) from error
    loaded = load_model(args.path, args.data, cpu=args.cpu)
    syntax = SourceSyntax.from_args(args)
    modules = attention_modules(loaded.model, types=args.attention_type)
    if not modules:
        raise AnalysisInputError(
            f"{args.path}: the model has no attention of type {', '.join(args.attention_type)}"
        )
    if syntax is not None and "encoder_self" not in args.attention_type:
        logger.warning("--conllu/--spacy-model: syntactic roles concern encoder_self only")
    statistics = {
        key: new_statistics(loaded, key, module, thresholds) for key, module in modules.items()
    }
    relevance = None if args.no_relevance else HeadRelevance(args.attention_type)
    counts = analyse(loaded, args, syntax, statistics, relevance, rule)
    if relevance is not None:
        for key, means in relevance.means().items():
            if key in statistics:
                statistics[key].relevance = means
    results = summarise(args, modules, statistics, thresholds, rule, syntax, counts)
    print(format_heads_table(results))
    write_json(args.output_dir, "heads.json", results)
    save_figure(plot_heads(results), args.output_dir, "heads.png")
    print(f"\nwrote heads.json and heads.png to {args.output_dir}")
    return 0


def new_statistics(loaded, key, module, thresholds: Thresholds) -> HeadStatistics:
    # keys are source tokens except in decoder self-attention
    dictionary = loaded.target_dictionary if key[0] == "decoder_self" else loaded.source_dictionary
    excluded = {dictionary.eos(), dictionary.pad(), dictionary.bos()}
    return HeadStatistics(
        module.num_heads, dictionary.count, excluded, dictionary.unk(), thresholds.rare_top_n
    )


def analyse(loaded, args, syntax, statistics, relevance, rule) -> Dict[str, int]:
    model = loaded.model
    counts = {"sentences": 0, "with_target": 0, "relevance_steps": 0}
    for sentence in read_sentences(loaded, args):
        record, _ = record_forward(model, sentence.sample)
        weights = attention_weights(record)
        net_input = sentence.sample["net_input"]
        counts["sentences"] += 1
        if "prev_output_tokens" in net_input:
            counts["with_target"] += 1
            if relevance is not None:
                result = propagate_relevance(model, sentence.sample, rule, record)
                relevance.add(result)
                counts["relevance_steps"] += int(result.steps_mask.sum())
        pairs = syntax.relations(sentence) if syntax is not None else None
        source = net_input["src_tokens"][0]
        target = net_input["prev_output_tokens"][0] if "prev_output_tokens" in net_input else None
        for key, stats in statistics.items():
            if key not in weights:
                continue  # decoder attention of a sentence without target
            queries = source if key[0] == "encoder_self" else target
            keys = target if key[0] == "decoder_self" else source
            stats.add(weights[key][0], queries, keys, pairs if key[0] == "encoder_self" else None)
    decoder_types = [t for t in args.attention_type if t != "encoder_self"]
    if decoder_types and counts["with_target"] == 0:
        raise AnalysisInputError(
            f"{', '.join(decoder_types)} needs target sentences (--target-text or a subset "
            "with targets)"
        )
    if relevance is not None and counts["with_target"] == 0:
        logger.warning("no target sentences: LRP relevance is left out (it explains predictions)")
    return counts


def summarise(args, modules, statistics, thresholds, rule, syntax, counts) -> dict:
    attention: Dict[str, list] = {}
    baselines: Dict[str, dict] = {}
    for key, module in modules.items():
        stats = statistics[key]
        heads = stats.summary(thresholds)
        for number, entry in zip(head_numbers(module), heads):
            entry["head"] = number
            entry["label"] = role_label(entry)
        attention.setdefault(key[0], []).append({"layer": key[1], "heads": heads})
        if key[0] == "encoder_self":
            baselines.update({f"{r} {d}": b for (r, d), b in stats.baselines().items()})
    return {
        "checkpoint": args.path,
        "sentences": counts["sentences"],
        "relevance": (
            {
                "rule": rule.name,
                "alpha": rule.alpha if rule.name == "alpha-beta" else None,
                "target_steps": counts["relevance_steps"],
            }
            if not args.no_relevance
            else None
        ),
        "thresholds": vars(thresholds),
        "syntax": None if syntax is None else {**syntax.summary(), "baselines": baselines},
        "attention": attention,
    }


# -- table and figure --------------------------------------------------------------------------
def format_heads_table(results: dict) -> str:
    rows = []
    for kind, layers in results["attention"].items():
        for layer in layers:
            for entry in layer["heads"]:
                positional = entry["positional"]
                best = best_relation(entry)
                rows.append(
                    [
                        kind,
                        layer["layer"],
                        entry["head"],
                        entry["relevance"],
                        entry["confidence"],
                        "-" if positional["offset"] is None else f"{positional['offset']:+d}",
                        positional["fraction"],
                        entry["rare_words"]["fraction"],
                        best,
                        entry["label"],
                    ]
                )
    headers = ["attention", "layer", "head", "relevance", "confidence", "offset", "at offset",
               "rarest", "best relation (acc/base)", "role"]  # fmt: skip
    return format_table(headers, rows)


def best_relation(entry: dict) -> str:
    scored = [(r["accuracy"] - r["baseline"], name, r) for name, r in entry["syntactic"].items()
              if r["accuracy"] is not None]  # fmt: skip
    if not scored:
        return "-"
    _, name, r = max(scored, key=lambda item: item[0])
    return f"{name} {r['accuracy']:.2f}/{r['baseline']:.2f}"


def plot_heads(results: dict):
    """Per attention type, three panels as Voita et al.'s Figure 1: the heads of each layer
    sorted by relevance (by confidence when relevance is unknown), coloured by relevance, by
    confidence, and by role."""
    plt = pyplot()
    from matplotlib.patches import Patch

    kinds = list(results["attention"])
    most_layers = max(len(results["attention"][kind]) for kind in kinds)
    height = len(kinds) * (0.5 + 0.45 * most_layers) + 1.0
    figure, axes = plt.subplots(len(kinds), 3, figsize=(13, height), squeeze=False)
    for row, kind in zip(axes, kinds):
        _plot_attention_type(row, kind, results["attention"][kind])
    handles = [Patch(color=c, label=r) for r, c in ROLE_COLOURS.items() if r in ROLES]
    handles.append(Patch(color=NO_ROLE_COLOUR, label="none"))
    figure.tight_layout(rect=(0, 0.06, 1, 1))
    figure.legend(handles=handles, loc="lower right", ncol=4, fontsize=8, frameon=False)
    return figure


def _plot_attention_type(row, kind: str, layers: list):
    from matplotlib.colors import to_rgb

    width = max(len(layer["heads"]) for layer in layers)
    by_relevance = all(h["relevance"] is not None for la in layers for h in la["heads"])
    order_key = "relevance" if by_relevance else "confidence"
    relevance = np.full((len(layers), width), np.nan)
    confidence = np.full((len(layers), width), np.nan)
    colours = np.ones((len(layers), width, 3))
    labels = [[""] * width for _ in layers]
    for i, layer in enumerate(layers):
        heads = sorted(layer["heads"], key=lambda h: -(h[order_key] or 0.0))
        for j, head in enumerate(heads):
            relevance[i, j] = np.nan if head["relevance"] is None else head["relevance"]
            confidence[i, j] = np.nan if head["confidence"] is None else head["confidence"]
            role = head["roles"][0] if head["roles"] else None
            colours[i, j] = to_rgb(ROLE_COLOURS.get(role, NO_ROLE_COLOUR))
            labels[i][j] = head["label"] if head["roles"] else ""
    names = [f"layer {layer['layer']}" for layer in layers]
    _heat_map(row[0], relevance, names, f"{kind}: relevance (LRP)", "Reds", layers, order_key)
    _heat_map(row[1], confidence, names, f"{kind}: confidence", "Blues", layers, order_key)
    row[2].imshow(colours, aspect="auto")
    for i, line in enumerate(labels):
        for j, text in enumerate(line):
            row[2].text(j, i, text, ha="center", va="center", fontsize=8, color="white")
    _axes_labels(row[2], names, f"{kind}: roles", order_key)


def _heat_map(axis, values, names, title, colours, layers, order_key):
    image = axis.imshow(values, aspect="auto", cmap=colours, vmin=0.0)
    axis.figure.colorbar(image, ax=axis, fraction=0.04)
    dark = 0.6 * image.get_clim()[1]
    for i, layer in enumerate(layers):
        heads = sorted(layer["heads"], key=lambda h: -(h[order_key] or 0.0))
        for j, head in enumerate(heads):
            colour = "white" if values[i, j] > dark else "black"
            axis.text(j, i, str(head["head"]), ha="center", va="center", fontsize=7, color=colour)
    _axes_labels(axis, names, title, order_key)


def _axes_labels(axis, names, title, order_key):
    axis.set_yticks(range(len(names)), names)
    axis.set_xticks([])
    axis.set_xlabel(f"heads of each layer, by {order_key} (number: head)")
    axis.set_title(title, fontsize=10)
