"""Pruning encoder heads on the Ding demo's data: Voita et al.'s procedure (Section 6.2).

1. the Ding demo's baseline Transformer (8 heads x 6 encoder layers = 48 heads; trained if
   missing);
2. for every lambda: fine-tune it with Hard Concrete gates on the encoder heads and the L0
   criterion, the decoder fixed (``--head-gates enc --freeze-decoder``), two runs side by side;
3. prune the closed heads out of the checkpoint (as ``scripts/prune_heads.py`` does);
4. BLEU of the gated model (test-time gates) and of the pruned model on the test split.

Writes a table of BLEU against the number of encoder heads kept (the shape of the paper's
Figure 7) to ``WORK/pruning/results.md``.

    python scripts/prune_demo.py [--lambdas 0.02,0.05,0.1,0.2] [--finetune-epochs 3]
"""

import argparse
import json
import math
import os
import time

from ..cli_types import positive_int
from ..file_safety import atomic_write_text
from . import demo
from .fairseq_runner import USER_DIR, exit_on_failure
from .study_report import pruned_checkpoint

ENCODER_HEADS = 48  # the demo's 6 layers x 8 heads
# The baseline is the demo's: fine-tuned with the demo's cores per run (two side by side).
SIDE_BY_SIDE = len(demo.MODELS)


def train_baseline(bin_dir, data_dir, epochs):
    """The Ding demo's baseline Transformer (the one ``make demo DEMO_ARGS="--corpus ding-de-en"``
    trains on the same data settings, reused when it has)."""
    label, arch, extra = demo.MODELS[0]
    job = demo.training_job(
        label, bin_dir, ["--arch", arch, *extra, *demo.MODEL_DIMS, *demo.SCHEDULE], epochs,
        demo.model_dir(data_dir, arch, epochs),
    )  # fmt: skip
    demo.train_unfinished([job], SIDE_BY_SIDE)
    return demo.checkpoint_of(job)


def gated_job(bin_dir, baseline, save_dir, l0_lambda, epochs, log_alpha_init):
    """Fine-tuning of the baseline with encoder head gates and the L0 penalty ``l0_lambda``."""
    schedule = [a for a in demo.SCHEDULE if a != "--no-last-checkpoints"]
    options = [
        "--arch", "transformer_local", "--user-dir", USER_DIR, *demo.MODEL_DIMS, *schedule,
        "--finetune-from-model", baseline, "--head-gates", "enc", "--freeze-decoder",
        "--head-gate-log-alpha-init", log_alpha_init,
        "--criterion", "label_smoothed_cross_entropy_l0", "--l0-lambda", l0_lambda,
    ]  # fmt: skip
    return demo.training_job(f"lambda {l0_lambda:g}", bin_dir, options, epochs, save_dir)


def finetuning_name(l0_lambda, epochs, log_alpha_init):
    """The folder of one fine-tuning, named by every setting it depends on besides its baseline
    (the folder above it), so that a run with other settings never reuses its checkpoints."""
    return f"lambda{l0_lambda:g}_ft{epochs}_init{log_alpha_init:g}"


def results_table(rows):
    lines = [
        "| lambda | encoder heads kept | BLEU gated (test-time gates) | BLEU pruned |",
        "|---:|---:|---:|---:|",
    ]
    for r in rows:
        gated = "-" if r["bleu_gated"] is None else f"{r['bleu_gated']:.2f}"
        lines.append(
            f"| {r['lambda']:g} | {r['encoder_heads']} / {ENCODER_HEADS} | {gated} "
            f"| {r['bleu_pruned']:.2f} |"
        )
    return "\n".join(lines)


def lambda_list(text):
    """An argparse ``type`` for --lambdas: distinct positive numbers, comma-separated. Parsed
    with the other options, so that a typo fails before data preparation and the baseline's
    training, not after; two equal lambdas would train side by side into one folder."""
    values, names = [], set()
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated numbers, got {item.strip()!r}"
            ) from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"a lambda must be a positive number, got {item!r}")
        if f"{value:g}" in names:  # the run folder's name: finetuning_name
            raise argparse.ArgumentTypeError(f"{value:g} is given twice")
        names.add(f"{value:g}")
        values.append(value)
    return values


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    demo.add_work_dir(parser, demo.DEFAULT_WORK_DIR, "the demo's folder")
    parser.add_argument(
        "--epochs",
        type=positive_int,
        default=os.environ.get("DEMO_EPOCHS") or "16",  # a string default goes through the type
        help="epochs of the baseline (env DEMO_EPOCHS; default 16, the Ding demo's)",
    )
    parser.add_argument(
        "--lambdas",
        type=lambda_list,
        default="0.02,0.05,0.1,0.2",
        help="L0 penalties, one fine-tuning each: distinct positive numbers, comma-separated",
    )
    parser.add_argument("--finetune-epochs", type=positive_int, default=3)
    parser.add_argument("--log-alpha-init", type=float, default=1.0)
    parser.add_argument("--vocab-size", type=positive_int, default=demo.DEFAULT_VOCAB_SIZE)
    parser.add_argument(
        "--max-train", type=positive_int, default=None, help="train on this many pairs only"
    )
    return parser.parse_args(argv)


def run_demo(args):
    started = time.time()
    work = os.path.abspath(args.work_dir)
    data_dir = demo.data_dir_for(work, args.vocab_size, args.max_train)
    bin_dir = demo.prepare_data(data_dir, demo.DING_CORPUS, args.vocab_size, args.max_train)
    baseline = train_baseline(bin_dir, data_dir, args.epochs)
    out_dir = os.path.join(work, "pruning")  # the results, where they have always been
    os.makedirs(out_dir, exist_ok=True)
    rows = [{"lambda": 0.0, "encoder_heads": ENCODER_HEADS, "bleu_gated": None}]
    # the demo's own scoring of this baseline (same file name), shared when the demo ran first
    base_scores = os.path.join(os.path.dirname(baseline), "generate-test.txt")
    rows[0]["bleu_pruned"] = demo.bleu(bin_dir, baseline, base_scores)
    lambdas = args.lambdas
    # the fine-tunings live under the baseline they start from (keyed by its data and epochs)
    runs = os.path.join(os.path.dirname(baseline), "pruning")
    run_dirs = [
        os.path.join(runs, finetuning_name(l0, args.finetune_epochs, args.log_alpha_init))
        for l0 in lambdas
    ]
    jobs = [
        gated_job(bin_dir, baseline, run_dir, l0, args.finetune_epochs, args.log_alpha_init)
        for l0, run_dir in zip(lambdas, run_dirs)
    ]
    demo.train_unfinished(jobs, SIDE_BY_SIDE)
    for l0_lambda, run_dir, job in zip(lambdas, run_dirs, jobs):
        gated = demo.checkpoint_of(job, "checkpoint_last.pt")
        pruned, heads = pruned_checkpoint(gated, os.path.join(run_dir, "pruned.pt"))
        rows.append(
            {
                "lambda": l0_lambda,
                "encoder_heads": heads,
                "bleu_gated": demo.bleu(bin_dir, gated, os.path.join(run_dir, "gated.txt")),
                "bleu_pruned": demo.bleu(bin_dir, pruned, os.path.join(run_dir, "pruned.txt")),
            }
        )

    table = results_table(rows)
    header = (
        f"Ding de-en test (1000 sentences): baseline trained {args.epochs} epochs, then "
        f"{args.finetune_epochs} epochs of fine-tuning with encoder head gates per lambda"
    )
    atomic_write_text(os.path.join(out_dir, "results.md"), f"{header}\n\n{table}\n")
    results = json.dumps({"args": vars(args), "rows": rows}, indent=2)
    atomic_write_text(os.path.join(out_dir, "results.json"), results)
    print(f"\n{header}, {(time.time() - started) / 60:.1f} min\n\n{table}")


def main(argv=None):
    args = parse_args(argv)
    with demo.claimed_work_dir(args):
        exit_on_failure(run_demo, args)
