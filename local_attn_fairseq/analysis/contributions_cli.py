"""``local-attn-analyze contributions``: encoder contributions, their diagonality and the local
attention windows they suggest (Alastruey et al. 2022, Table 1 and Figures 3-4).

    local-attn-analyze contributions --path asr/checkpoint_best.pt --data DATA \\
        --config-yaml config_asr.yaml --gen-subset dev_asr --num-sentences 400 --output-dir out \\
        [--compare-path st/checkpoint_best.pt --compare-config-yaml config_st.yaml \\
         --compare-gen-subset dev_st]

Prints, per model, a block in the layout of the paper's Table 1 (layer, mu +- sigma of the
per-sentence widths, w, CL; plus CCD and the window written to windows.txt), titled with the
model's task (``loading.task_description``) or its ``--label``. Writes, in
--output-dir: ``contributions.json`` (per layer: mu, sigma, w, CL, CCD; and the same
for the compared model), ``windows.txt`` (the value of ``--encoder-attention-windows`` for
``s2t_transformer_local``), ``contribution_matrices.png`` (one sentence, main diagonal hidden,
the chosen windows outlined) and ``ccd.png`` (CCD per layer, both models).
"""

import os
import random

import numpy as np
from tqdm import tqdm

from ..cli_types import non_negative_int, positive_int
from ..file_safety import atomic_write_text
from . import contributions as contrib
from .loading import (
    AnalysisInputError,
    add_checkpoint_arguments,
    add_output_arguments,
    encoder_self_attention_modules,
    float_between,
    load_model,
    load_subset,
    task_description,
)
from .output import output_path, pyplot, save_figure, write_json

HELP = "contributions of encoder self-attention (Alastruey et al.): windows, CL and CCD per layer"


def add_arguments(parser):
    add_checkpoint_arguments(parser, gen_subset="dev_asr", data_required=True)
    parser.add_argument(
        "--config-yaml", help="speech_to_text: the data config (e.g. config_asr.yaml)"
    )
    parser.add_argument(
        "--label",
        help="name of the model in plots and tables (default: its task, e.g. speech "
        "recognition, translation (de-en))",
    )
    parser.add_argument("--compare-path", help="a second checkpoint (e.g. the ST model)")
    parser.add_argument("--compare-data", help="its data directory (default: --data)")
    parser.add_argument("--compare-config-yaml", help="its data config (e.g. config_st.yaml)")
    parser.add_argument("--compare-gen-subset", default="dev_st")
    parser.add_argument("--compare-label", help="its name (default: its task)")
    parser.add_argument(
        "--num-sentences", type=positive_int, default=400, help="random sample size"
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the random sample")
    parser.add_argument(
        "--batch-size", type=positive_int, default=16, help="sentences per forward pass"
    )
    # contributions are row-normalised shares, so a diagonal's mean lies in [0, 1]
    parser.add_argument(
        "--threshold",
        type=float_between(0.0, 1.0),
        default=contrib.DEFAULT_THRESHOLD,
        help="Algorithm 1's t, in [0, 1]: least mean contribution (a share of the row) of a "
        "sub/super-diagonal inside a window",
    )
    parser.add_argument(
        "--window-width-convention",
        choices=contrib.WIDTH_CONVENTIONS,
        default=contrib.DEFAULT_WIDTH_CONVENTION,
        help="Algorithm 1's width of a sentence whose last offset above t is i: 2i (default; "
        "the convention under which the paper's Table 1 statistics are reachable) or 2i+1 "
        "(the algorithm as printed; windows often come out 2 wider)",
    )
    parser.add_argument(
        "--max-contribution-loss",
        type=float_between(0.0, 1.0),
        default=contrib.DEFAULT_MAX_CONTRIBUTION_LOSS,
        help="layers whose window leaves out at least this share (CL, in [0, 1]) stay global "
        "in windows.txt (the paper's tables separate at 0.25)",
    )
    parser.add_argument(
        "--global-layers",
        type=non_negative_int,
        help="instead of the CL rule, keep exactly the first N layers global (the paper: 3); "
        "at most the model's number of encoder layers",
    )
    parser.add_argument(
        "--plot-sentence",
        type=non_negative_int,
        default=0,
        help="which sampled sentence contribution_matrices.png shows (its position in the "
        "sample, 0-based, below --num-sentences and the subset's size)",
    )
    add_output_arguments(parser, output_dir=None)


def run(args):
    primary = analyse(
        args.path, args.data, args.config_yaml, args.gen_subset, args.label, args, primary=True
    )
    chosen = contrib.choose_windows(
        primary["layers"], args.max_contribution_loss, args.global_layers
    )
    windows = ",".join(map(str, chosen))
    results = {**primary, "encoder_attention_windows": windows}
    for layer, window in zip(results["layers"], chosen):
        layer["chosen_window"] = window
    rule = (
        f"the first {args.global_layers} layers (--global-layers)"
        if args.global_layers is not None
        else f"CL >= {args.max_contribution_loss} (--max-contribution-loss)"
    )
    results["global_rule"] = rule + ", or w spanning every analysed sentence whole"
    print_table(results)
    compared = None
    if args.compare_path:
        compared = analyse(
            args.compare_path,
            args.compare_data or args.data,
            args.compare_config_yaml,
            args.compare_gen_subset,
            args.compare_label,
            args,
        )
        print_table(compared)
        results["compare"] = {k: v for k, v in compared.items() if k != "plot"}
    plot_matrices(results["plot"], chosen, results["label"], args.output_dir)
    plot_ccd([results, compared] if compared else [results], args.output_dir)
    atomic_write_text(output_path(args.output_dir, "windows.txt"), windows + "\n")
    write_json(
        args.output_dir, "contributions.json", {k: v for k, v in results.items() if k != "plot"}
    )
    print(f"\n--encoder-attention-windows {windows}")
    written = "contributions.json, windows.txt, contribution_matrices.png, ccd.png"
    print(f"wrote {written} to {args.output_dir}")
    return 0


def sample_batches(task, subset, num_sentences, seed, batch_size):
    """A seeded random sample of the subset, batched in order of length (little padding);
    also returns the sample's dataset indices in drawn order."""
    dataset = load_subset(task, subset)
    drawn = random.Random(seed).sample(range(len(dataset)), min(num_sentences, len(dataset)))
    by_length = sorted(drawn, key=dataset.num_tokens)
    chunks = [by_length[i : i + batch_size] for i in range(0, len(by_length), batch_size)]
    return dataset, chunks, drawn


def analyse(path, data, config_yaml, subset, label, args, primary=False):
    """Per-layer statistics of one checkpoint over the sample, plus one sentence for the plot,
    under ``label`` (default: the checkpoint's task). The options that depend on the model and
    its data are checked before any sentence runs."""
    loaded = load_model(path, data, cpu=args.cpu, config_yaml=config_yaml)
    encoder_self_attention_modules(loaded, path)  # a language model has none: say so
    encoder_layers = contrib.encoder_layers(loaded.model)
    try:
        contrib.check_decomposable(encoder_layers)
    except ValueError as error:  # a model the decomposition does not fit (post-LN, ...)
        raise AnalysisInputError(f"{path}: {error}") from None
    # --global-layers chooses the windows of the first model only
    if primary and args.global_layers is not None and args.global_layers > len(encoder_layers):
        raise AnalysisInputError(
            f"--global-layers {args.global_layers}: {path} has {len(encoder_layers)} encoder "
            f"layers; give a number from 0 to {len(encoder_layers)}"
        )
    dataset, chunks, drawn = sample_batches(
        loaded.task, subset, args.num_sentences, args.seed, args.batch_size
    )
    if args.plot_sentence >= len(drawn):
        raise AnalysisInputError(
            f"--plot-sentence {args.plot_sentence}: the sample of {subset!r} for {path} has "
            f"{len(drawn)} sentences; give a position from 0 to {len(drawn) - 1}"
        )
    plotted = drawn[args.plot_sentence]
    layers, plot = None, None
    progress = tqdm(total=len(drawn), desc=f"contributions {os.path.basename(path)}", unit="sent")
    for chunk in chunks:
        batch = dataset.collater([dataset[i] for i in chunk])
        net_input = {
            k: v.to(loaded.device) for k, v in batch["net_input"].items() if k.startswith("src")
        }
        pieces = contrib.encoder_pieces(loaded.model, net_input)
        layers = layers or [contrib.LayerSample(args.window_width_convention) for _ in pieces]
        for layer, sample, per_sentence in zip(range(len(pieces)), layers, pieces):
            for position, sentence in enumerate(per_sentence):
                normalised = contrib.normalise_rows(contrib.contribution_matrix(sentence).cpu())
                sample.add(normalised, args.threshold)
                if chunk[position] == plotted:
                    plot = plot or {"sentence": plotted, "matrices": []}
                    plot["matrices"].append(normalised.float().numpy())
        progress.update(len(chunk))
    progress.close()
    task = task_description(loaded)
    return {
        "label": label or task,
        "task": task,
        "checkpoint": path,
        "subset": subset,
        "num_sentences": len(drawn),
        "threshold": args.threshold,
        "width_convention": args.window_width_convention,
        "layers": [sample.summary(index + 1) for index, sample in enumerate(layers)],
        "plot": plot,
    }


def print_table(results):
    """One block per model in the layout of the paper's Table 1: layer (* where attention stays
    global), mu +- sigma of the per-sentence widths, w = ceil(mu + sigma) made odd, CL of w;
    then CCD and the window written to windows.txt."""
    print(
        f"\n{results['label']}: {results['checkpoint']} on {results['subset']}, "
        f"{results['num_sentences']} sentences, t = {results['threshold']}"
    )
    print(
        f"Algorithm 1 per-sentence width {results['width_convention']}; "
        "w = ceil(mu + sigma), made odd; CL = 1 - D(w)"
    )
    print(f"{'Layer':<7}  {'mu +- sigma':>15}  {'w':>3}  {'CL':>12}  {'CCD':>14}  used")
    for s in results["layers"]:
        used = s.get("chosen_window")
        star = " *" if used == 0 else ""
        used = "" if used is None else ("global" if used == 0 else str(used))
        print(
            f"{str(s['layer']) + star:<7}  {s['window_mean']:6.2f} +- {s['window_std']:5.2f}  "
            f"{s['window']:>3}  {s['contribution_loss_mean']:.2f} +- "
            f"{s['contribution_loss_std']:.2f}  {s['ccd_mean']:.3f} +- {s['ccd_std']:.3f}  {used}"
        )
    if "global_rule" in results:
        print(f"(*) standard self-attention in windows.txt: {results['global_rule']}")


def plot_matrices(plot, windows, label, output_dir):
    """Figure 4: each layer's contribution matrix of one sentence, main diagonal hidden (it
    holds most of every row and would wash out the rest), the layer's window outlined."""
    plt = pyplot()
    matrices = plot["matrices"]
    cols = min(4, len(matrices))
    rows = -(-len(matrices) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 3 * rows), squeeze=False)
    for ax in axes.flat[len(matrices) :]:
        ax.axis("off")
    for layer, (ax, matrix) in enumerate(zip(axes.flat, matrices)):
        shown = matrix.copy()
        np.fill_diagonal(shown, np.nan)
        ax.imshow(shown, cmap="Blues", interpolation="nearest")
        n = matrix.shape[0]
        half = (windows[layer] - 1) // 2 if windows[layer] else None
        if half is not None:
            edges = np.array([-0.5, n - 0.5])
            for offset in (-half - 0.5, half + 0.5):  # the window's edges, j - i = offset
                ax.plot(edges, edges - offset, color="red", lw=0.8)
            ax.set_xlim(-0.5, n - 0.5)
            ax.set_ylim(n - 0.5, -0.5)
        title = f"layer {layer + 1}" + (f", w={windows[layer]}" if half is not None else ", global")
        ax.set_title(title, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(f"{label}: contributions, sentence {plot['sentence']} (main diagonal hidden)")
    fig.tight_layout()
    save_figure(fig, output_dir, "contribution_matrices.png")


def plot_ccd(all_results, output_dir):
    """Figure 3: mean CCD per layer, the first model dashed, the compared one solid."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for results, style in zip(all_results, ("--", "-")):
        layers = [s["layer"] for s in results["layers"]]
        ccd = [s["ccd_mean"] for s in results["layers"]]
        ax.plot(layers, ccd, style, marker="o", label=results["label"])
    ax.set_xlabel("encoder layer")
    ax.set_ylabel("CCD (area under D(w) / (2N - 1))")
    ax.set_xticks(layers)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, output_dir, "ccd.png")
