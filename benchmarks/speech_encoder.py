#!/usr/bin/env python3
"""Speech encoder training cost: local attention (Alastruey et al.'s windows) against global.

    python benchmarks/speech_encoder.py [--seconds 10 30 60] [--batch 2] [--rounds 3]
    python benchmarks/speech_encoder.py --device cuda --dtype bfloat16 --batch 8
    python benchmarks/speech_encoder.py --arch s2t_transformer_local_tiny --windows 0,0,3,5,5,7 \
        --seconds 6 --batch 16   # the speech study's model at its corpus's mean length
    python benchmarks/speech_encoder.py --memory-seconds 600 3600 --batch 1 \
        --windows 5,5,5,5,5,9,13,11,15,19,17,21   # training memory at 10 min and 1 h of speech

Both encoders are ``s2t_transformer_local`` at the paper's size (fairseq's s2t_transformer_s:
12 layers, d=256, 4 heads, FFN 2048, two strided Conv1d layers; ``--arch`` picks another size),
with the same weights: "local" uses the Table 1 windows (0,0,0,5,5,9,13,11,15,19,17,21; the
banded operator; ``--windows`` others, one per layer), "global" sets
every window to 0 (PyTorch's fused attention). Inputs are 80-dim fbank features at 100 frames per
second (10 s = 1000 frames = 250 encoder frames after the x4 subsampler), in training mode with
the paper's dropout 0.1.

Time: one forward + backward of the encoder (loss: sum of the outputs), the median of --rounds
rounds, the two models alternating within each round so that load from other processes on a
shared machine hits them alike. Memory: the peak of the bytes torch allocates during one
forward + backward (CPU: from the allocation events of torch's profiler; CUDA:
torch.cuda.max_memory_allocated), above what was live before, measured as
benchmarks/banded_attention.py measures it (``local_attn_fairseq.experiments.measurement``).
The FLOP ceiling is the ratio of the two encoders' matrix-product operations (convolutions,
projections, attention products): the most the speed-up can be where those products bound the
speed. Target: local >= 1.5x faster than global at 60 s.

``--memory-seconds``: training memory at long lengths instead of the timing table. Each
encoder's peak is first estimated (its T^2 term and linear growth from the peaks at 20, 40 and
60 s, as benchmarks/long_context.py estimates an LM's), then measured by one forward + backward
where the estimate is within ``--memory-cap-gb``; over the cap it is reported as not fitting,
with its estimate, and not run.
"""

import argparse
import os
import sys

# As in benchmarks/banded_attention.py: passive OpenMP workers on a shared machine.
if "--spin" not in sys.argv:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from local_attn_fairseq.cli_types import output_file, positive_int  # noqa: E402
from local_attn_fairseq.experiments.measurement import (  # noqa: E402
    add_overwrite_option,
    check_output_file,
    write_output_file,
)
from local_attn_fairseq.experiments.speech_encoder_cost import (  # noqa: E402
    FRAMES_PER_SECOND,
    GiB,
    build_encoder,
    matmul_flops,
    measure,
    memory_report,
    memory_table,
)
from local_attn_fairseq.models import s2t_transformer_local as s2t  # noqa: E402

# --arch: the registered sizes of s2t_transformer_local, and their default windows
ARCHITECTURES = {
    "s2t_transformer_local": (s2t.s2t_transformer_local, s2t.PAPER_WINDOWS),
    "s2t_transformer_local_m": (s2t.s2t_transformer_local_m, s2t.PAPER_WINDOWS),
    "s2t_transformer_local_tiny": (s2t.s2t_transformer_local_tiny, s2t.DEFAULT_WINDOWS[6]),
}

MiB = 2**20
TARGET_SPEEDUP = 1.5


# The first words of the table (and of the --output file) this benchmark writes.
TABLE_START = "s2t_transformer_local encoder ("


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=positive_int, nargs="+", default=[10, 30, 60])
    parser.add_argument("--batch", type=positive_int, default=2, help="utterances per batch")
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument(
        "--memory-seconds", type=positive_int, nargs="+",
        help="report training memory at these lengths of speech (e.g. 600 3600) instead of time",
    )  # fmt: skip
    parser.add_argument(
        "--memory-cap-gb", type=float, default=16.0,
        help="--memory-seconds: an encoder estimated above this many GiB is reported as not "
        "fitting, not run (default 16)",
    )  # fmt: skip
    parser.add_argument(
        "--arch", choices=sorted(ARCHITECTURES), default="s2t_transformer_local",
        help="the encoder's size (default: the paper's, fairseq's s2t_transformer_s)",
    )  # fmt: skip
    parser.add_argument(
        "--windows",
        help="the local model's windows, one per layer (default: the paper's Table 1 for the "
        "12-layer sizes, 0,0,3,5,5,7 for the tiny one)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="weights and features (float16: CUDA only)",
    )
    parser.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--spin", action="store_true", help="keep OpenMP's spinning workers")
    parser.add_argument("--output", type=output_file, help="also write the table to this file")
    add_overwrite_option(parser)
    args = parser.parse_args(argv)
    if args.memory_cap_gb <= 0:
        parser.error(f"--memory-cap-gb: must be above 0, got {args.memory_cap_gb:g}")
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    if args.dtype == "float16" and args.device.type != "cuda":
        parser.error("--dtype float16 needs --device cuda (use bfloat16 or float32 on the CPU)")
    args.dtype = getattr(torch, args.dtype)
    args.arch_fn, default_windows = ARCHITECTURES[args.arch]
    args.windows = args.windows or default_windows
    if args.output:
        check_output_file(args.output, "--output", args.overwrite)
    return args


def device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def encoder_title(args, model_args) -> str:
    """The table's first words: the encoder's size."""
    return (
        f"{TABLE_START}{args.arch}, {model_args.encoder_layers} x d"
        f"{model_args.encoder_embed_dim}, {model_args.encoder_attention_heads} heads)"
    )


def report_memory(args, models, model_args):
    cap = args.memory_cap_gb * GiB
    lines = [
        f"{encoder_title(args, model_args)}, training memory of one forward + backward, batch "
        f"{args.batch}, {device_name(args.device)}, {str(args.dtype).replace('torch.', '')}, "
        f"torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; local windows {args.windows}",
        "",
    ]
    print("\n".join(lines), flush=True)
    report = memory_report(
        models, args.memory_seconds, args.batch, cap, args.device, args.dtype,
        progress=lambda line: print(f"| {line}", flush=True),
    )  # fmt: skip
    lines += memory_table(report, cap)
    print("\n".join(lines[2:]), flush=True)
    if args.output:
        write_output_file(args.output, "--output", "\n".join(lines) + "\n")


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    try:
        local, model_args = build_encoder(args.windows, args.device, args.dtype, args.arch_fn)
    except ValueError as error:  # windows that do not fit the encoder's layers
        raise SystemExit(f"error: {error}") from None
    global_windows = ",".join("0" for _ in args.windows.split(","))
    dense, _ = build_encoder(global_windows, args.device, args.dtype, args.arch_fn)
    dense.load_state_dict(local.state_dict())
    models = {"global": dense, "local": local}
    if args.memory_seconds:
        return report_memory(args, models, model_args)
    windows = {name: [int(w) for w in m.attention_windows] for name, m in models.items()}

    lines = [
        f"{encoder_title(args, model_args)}, forward + backward, batch "
        f"{args.batch}, {device_name(args.device)}, {str(args.dtype).replace('torch.', '')}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} "
        f"threads; local windows {args.windows}; times: median of {args.rounds} rounds",
        "",
        "| audio | fbank frames | encoder frames | global s | local s | speed-up | "
        "FLOP ceiling | global peak MiB | local peak MiB | memory ratio"
        + (" | global GPU busy s | local GPU busy s |" if args.device.type == "cuda" else " |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        + ("---:|---:|" if args.device.type == "cuda" else ""),
    ]
    print("\n".join(lines), flush=True)
    speedups = {}
    for seconds in args.seconds:
        frames = seconds * FRAMES_PER_SECOND
        result = measure(models, frames, args.batch, args.rounds, args.device, args.dtype)
        encoder_frames = int(local.subsample.get_out_seq_lens_tensor(torch.tensor([frames])))
        (t_global, m_global, b_global), (t_local, m_local, b_local) = (
            result["global"],
            result["local"],
        )
        flops = {n: matmul_flops(model_args, frames, args.batch, windows[n]) for n in models}
        speedups[seconds] = t_global / t_local
        lines.append(
            f"| {seconds} s | {frames} | {encoder_frames} | {t_global:.3f} | {t_local:.3f} | "
            f"{t_global / t_local:.2f}x | {flops['global'] / flops['local']:.2f}x | "
            f"{m_global / MiB:.0f} | {m_local / MiB:.0f} | {m_global / max(m_local, 1):.2f}x |"
            + (f" {b_global:.3f} | {b_local:.3f} |" if b_global is not None else "")
        )
        print(lines[-1], flush=True)
    longest = max(speedups)
    verdict = "met" if speedups[longest] >= TARGET_SPEEDUP else "NOT met"
    lines.append(
        f"\nspeed-up at {longest} s: {speedups[longest]:.2f}x (target >= {TARGET_SPEEDUP}x: "
        f"{verdict})"
    )
    print(lines[-1])
    if args.output:
        write_output_file(args.output, "--output", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
