#!/usr/bin/env python3
"""A small-scale study of every mechanism on the demo's German-English data, at one budget.

The baseline and each paper's headline model are trained with the demo's sizes and schedule
(``scripts/demo.py``) for the same number of updates, with several seeds, then scored on the
test split. ``--jobs N`` runs N trainings side by side with the cores split between them
(models this small use two threads poorly, so two one-thread runs finish sooner than two
two-thread runs one after the other); every run then sees the same machine load, so their
words/s stay comparable. It writes a table (BLEU mean and spread over seeds, training words/s,
encoder attention parameters) to ``docs/small_scale_study.md`` and every number to a JSON file.

    python scripts/small_scale_study.py --updates 3000 --seeds 1,2,3 --jobs 2

The gated model (Voita et al.) is trained with its gates and the L0 penalty from the start, for
the same budget, then pruned; its BLEU is the pruned model's. This is a CPU-sized comparison:
it ranks the mechanisms at a small scale; the papers' numbers come from the recipes in
``scripts/recipes/`` (docs/reproduction.md).
"""

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "recipes")]

import demo  # noqa: E402
import fairseq_runner  # noqa: E402

USER_DIR = demo.USER_DIR
BANDED = (
    "{encoder_self: {all: [local-2, local-2, local-4, local-4, local-8, local-8, local-16, "
    "local-16]}}"
)
# name -> (label, fairseq-train options beyond the demo's sizes and schedule)
MODELS = {
    "baseline": ("transformer (baseline)", ["--arch", "transformer"]),
    "local_tied": (
        "transformer_local_tied (Pande et al. (i))",
        ["--arch", "transformer_local_tied"],
    ),
    "localness": ("transformer_localness (Yang et al.)", ["--arch", "transformer_localness"]),
    "dynwin": ("transformer_dynwin (Nguyen et al.)", ["--arch", "transformer_dynwin"]),
    "gates_l0": (
        "encoder head gates + L0, pruned (Voita et al.)",
        ["--arch", "transformer_local", "--head-gates", "enc",
         "--criterion", "label_smoothed_cross_entropy_l0", "--l0-lambda", "0.01"],
    ),  # fmt: skip
    "banded": (
        "banded local-K encoder, K = 2, 4, 8, 16 (Alastruey et al.'s form)",
        ["--arch", "transformer_local", "--locality-config", BANDED],
    ),
}


# --tiny: the demo's layers and heads at widths that make a smoke run of this script quick
TINY_WIDTHS = (
    "--encoder-embed-dim 32 --encoder-ffn-embed-dim 64 --decoder-embed-dim 32 "
    "--decoder-ffn-embed-dim 64"
).split()


def train(bin_dir, save_dir, extra, updates, seed, tiny=False):
    """One run of the demo's model and schedule for ``updates`` updates; returns its log."""
    log = os.path.join(save_dir, "train.log")
    if not demo.training_finished(save_dir):
        dims = demo.MODEL_DIMS + (TINY_WIDTHS if tiny else [])
        argv = [bin_dir, "--user-dir", USER_DIR, *dims, *study_schedule(), *extra]
        argv += ["--max-update", updates, "--seed", seed, "--save-dir", save_dir]
        argv += ["--disable-validation", "--no-save-optimizer-state"]
        fairseq_runner.run("fairseq-train", argv, log)
    with open(log, encoding="utf-8") as f:
        return f.read()


def study_schedule():
    """The demo's schedule without its seed (each run has its own) and with the last
    checkpoint kept: at a fixed budget the final model is the one scored."""
    schedule, dropped = [], {"--seed": 1, "--no-last-checkpoints": 0}
    tokens = iter(demo.SCHEDULE)
    for token in tokens:
        if token in dropped:
            for _ in range(dropped[token]):
                next(tokens)
        else:
            schedule.append(token)
    return schedule


def prune(checkpoint):
    from local_attn_fairseq.modules.head_pruning import prune_checkpoint

    pruned = checkpoint.replace(".pt", "_pruned.pt")
    _, kept, _ = prune_checkpoint(checkpoint, pruned)
    return pruned, sum(len(h) for h in kept["encoder_self"])


def bleu(bin_dir, checkpoint, out_dir):
    """sacreBLEU on the test split with the demo's decoding settings."""
    argv = [bin_dir, "--user-dir", USER_DIR, "--path", checkpoint, "--gen-subset", "test"]
    argv += ["--beam", 5, "--batch-size", 128, "--max-len-a", 1.2, "--max-len-b", 10]
    argv += ["--remove-bpe", "sentencepiece", "--scoring", "sacrebleu", "--num-workers", 0]
    # every sentence is decoded: batches need not be a multiple of 8 (fairseq's default)
    argv += ["--results-path", out_dir, "--required-batch-size-multiple", 1]
    scorer = fairseq_runner.run("fairseq-generate", argv, os.path.join(out_dir, "generate.log"))
    return round(scorer.score(), 2)


def run_model(name, bin_dir, work, args, seed):
    _, extra = MODELS[name]
    # one directory per budget: a finished run is reused only for the same number of updates
    save_dir = os.path.join(work, name, f"updates{args.updates}_seed{seed}")
    os.makedirs(save_dir, exist_ok=True)
    log = train(bin_dir, save_dir, extra, args.updates, seed, args.tiny)
    checkpoint = os.path.join(save_dir, "checkpoint_last.pt")
    result = {"seed": seed, "train_words_per_s": demo.words_per_second(log)}
    if name == "gates_l0":
        checkpoint, result["encoder_heads_kept"] = prune(checkpoint)
    result["encoder_attention_params"] = demo.encoder_attention_parameters(checkpoint)
    result["bleu"] = bleu(bin_dir, checkpoint, os.path.join(save_dir, "test"))
    return result


def start_worker(threads):
    """A side-by-side run's process: its share of the cores, fairseq's logging."""
    import torch

    torch.set_num_threads(threads)
    fairseq_runner.configure_logging()


def run_all(bin_dir, work, args):
    """{model: [result per seed]}, with ``args.jobs`` runs at a time."""
    tasks = [(name, seed) for name in args.models.split(",") for seed in args.seed_list]
    if args.jobs == 1:
        results = [run_model(name, bin_dir, work, args, seed) for name, seed in tasks]
    else:
        threads = max(1, (os.cpu_count() or 1) // args.jobs)
        with concurrent.futures.ProcessPoolExecutor(
            args.jobs, multiprocessing.get_context("spawn"), start_worker, (threads,)
        ) as pool:
            futures = [
                pool.submit(run_model, name, bin_dir, work, args, seed) for name, seed in tasks
            ]
            results = [f.result() for f in futures]
    runs = {}
    for (name, _), result in zip(tasks, results):
        runs.setdefault(name, []).append(result)
    return runs


def summarise(runs):
    """Mean and spread (sample standard deviation; 0 for one seed) over the seeds of a model."""
    scores = [r["bleu"] for r in runs]
    speeds = [r["train_words_per_s"] for r in runs]
    summary = {
        "bleu_mean": round(statistics.mean(scores), 2),
        "bleu_std": round(statistics.stdev(scores), 2) if len(scores) > 1 else 0.0,
        "bleu_min": min(scores),
        "bleu_max": max(scores),
        "train_words_per_s": round(statistics.mean(speeds)),
        "encoder_attention_params": runs[0]["encoder_attention_params"],
    }
    if "encoder_heads_kept" in runs[0]:
        summary["encoder_heads_kept"] = [r["encoder_heads_kept"] for r in runs]
    return summary


def markdown(study, command):
    seeds = ", ".join(map(str, study["seeds"]))
    lines = [
        "# Small-scale study",
        "",
        "Every mechanism of the plugin on the demo's German-English data (Ding dictionary "
        f"sentences, {study['train_pairs']} training pairs, BLEU on the {study['test_size']} "
        "test sentences), the demo's model ("
        + ("32 dims (--tiny)" if study["tiny"] else "128 dims")
        + ", 8 heads, 6 encoder and 2 decoder layers, pre-norm) and schedule, each model trained "
        f"for the same {study['updates']} updates with seeds {seeds}, "
        + (
            "one run at a time."
            if study["jobs"] == 1
            else f"{study['jobs']} runs side by side with the cores split evenly between them "
            "(every run under the same load, so words/s compare across models)."
        ),
        "",
        "| model | BLEU (mean ± std) | BLEU min-max | train words/s | encoder attention params |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, s in study["models"].items():
        label = MODELS[name][0]
        if "encoder_heads_kept" in s:
            label += f" ({'/'.join(map(str, s['encoder_heads_kept']))} of 48 encoder heads kept)"
        lines.append(
            f"| {label} | {s['bleu_mean']:.2f} ± {s['bleu_std']:.2f} | "
            f"{s['bleu_min']:.2f}-{s['bleu_max']:.2f} | {s['train_words_per_s']} | "
            f"{s['encoder_attention_params'] / 1e6:.3f}M |"
        )
    lines += [
        "",
        f"Command: `{command}` ({study['minutes']:.0f} minutes on {study['machine']}).",
        "",
        f"This is a small-scale comparison: {study['train_pairs']} pairs of short dictionary "
        "sentences, a "
        "model a CPU trains in minutes and a fixed, short budget. It says how the mechanisms "
        "rank when data and compute are scarce and what they cost in training speed here; it "
        "is not a reproduction of the papers, whose numbers come from the full-scale recipes "
        "(docs/reproduction.md). The gated model is trained with its gates from the start "
        "(Voita et al. fine-tune a converged model) and scored after pruning.",
        "",
    ]
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default=os.path.join(demo.ROOT, "study_runs"))
    parser.add_argument(
        "--updates", type=int, default=3000, help="training updates per run (3000: ~11 epochs)"
    )
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated training seeds")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset")
    parser.add_argument(
        "--jobs", type=int, default=1, help="runs side by side, the cores split between them"
    )
    parser.add_argument("--vocab-size", type=int, default=demo.DEFAULT_VOCAB_SIZE)
    parser.add_argument("--max-train", type=int, help="training pairs (default: all)")
    parser.add_argument(
        "--test-size", type=int, default=1000, help="test sentences held out (the demo's 1000)"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="32-dim models: a smoke run of the script, no study"
    )
    parser.add_argument("--out-md", default=os.path.join(demo.ROOT, "docs", "small_scale_study.md"))
    parser.add_argument("--out-json", help="default: WORK_DIR/small_scale_study.json")
    args = parser.parse_args(argv)
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        parser.error(f"--models: unknown {', '.join(sorted(unknown))} (known: {', '.join(MODELS)})")
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: expected comma-separated integers")
    if min(args.updates, args.test_size, args.jobs) < 1:
        parser.error("--updates, --test-size and --jobs must be at least 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    fairseq_runner.configure_logging()
    work = os.path.abspath(args.work_dir)
    started = time.time()
    if args.test_size == 1000:
        data_dir = demo.data_dir_for(work, args.vocab_size, args.max_train)
    else:  # another split of the sentences: a directory of its own
        train = f"_train{args.max_train}" if args.max_train else ""
        data_dir = os.path.join(work, f"data_spm{args.vocab_size}{train}_test{args.test_size}")
        os.makedirs(data_dir, exist_ok=True)
    bin_dir = demo.prepare_data(data_dir, args.vocab_size, args.max_train, args.test_size)
    models = {
        name: dict(summarise(runs), runs=runs)
        for name, runs in run_all(bin_dir, work, args).items()
    }
    with open(os.path.join(data_dir, "raw", "train.en"), encoding="utf-8") as f:
        train_pairs = sum(1 for _ in f)
    study = {
        "updates": args.updates,
        "tiny": args.tiny,
        "seeds": args.seed_list,
        "jobs": args.jobs,
        "train_pairs": f"{train_pairs:,}",
        "test_size": f"{args.test_size:,}",
        "minutes": (time.time() - started) / 60,
        "machine": f"{os.cpu_count()} CPU cores",
        "models": models,
    }
    command = "python scripts/small_scale_study.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    out_json = args.out_json or os.path.join(work, "small_scale_study.json")
    with open(out_json, "w") as f:
        json.dump(study, f, indent=2)
    os.makedirs(os.path.dirname(os.path.abspath(args.out_md)), exist_ok=True)
    with open(args.out_md, "w") as f:
        f.write(markdown(study, command.strip()))
    print(markdown(study, command.strip()))
    print(f"(written to {args.out_md} and {out_json})")


if __name__ == "__main__":
    main()
