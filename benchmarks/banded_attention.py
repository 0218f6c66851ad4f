#!/usr/bin/env python3
"""The banded attention operator against what a user would otherwise write, on CPU or GPU.

    python benchmarks/banded_attention.py [--quick] [--lengths 256 1024] [--widths 5 65]
    python benchmarks/banded_attention.py --device cuda --dtype bfloat16

Compared, for each sequence length T and band width w = left + right + 1 (left = right):
  banded  ``local_attn_fairseq.ops.banded_attention`` (the compiled kernel; ``--impl torch``
          measures the pure-PyTorch fallback instead);
  sdpa    ``torch.nn.functional.scaled_dot_product_attention`` with a boolean (T, T) band mask;
  naive   matmul, masked_fill, softmax, matmul;
  global  scaled_dot_product_attention without a mask: the global attention that a local layer
          replaces (on a GPU, PyTorch's flash kernel), for scale;
in two modes: forward only (under no_grad) and forward + backward.

Time: the median of --repeats rounds, the implementations alternating within each round, so
that load from other processes on a shared machine hits them alike. Memory: the peak of the
bytes torch allocates during one call (outputs, gradients, saved and temporary tensors), read
from the allocation events of torch's profiler (``profile_memory=True``) on the CPU and from
the caching allocator's peak statistic on the GPU, plus, for the dense
implementations, the (T, T) mask they need resident. The mask is built outside the timed region
(a model would build it once). "Beyond outputs" leaves out what every implementation allocates
alike (the output, and for forward + backward the seed gradient and the three input gradients):
the memory each one needs to compute them. GFLOP/s counts the useful band work, 4 * T * w * D
per head forward and 3x that for forward + backward, and is compared with the device's peak,
estimated by timing a large matmul of the same dtype in the same run (on a GPU, the banded
kernels work on CUDA cores, so a fraction of the tensor-core matmul peak is expected). Dense implementations are skipped
where their T x T tensors would exceed --dense-memory-gb.
"""

import argparse
import os
import statistics
import sys
import time

# Before torch starts its OpenMP pool: idle workers then wait passively instead of spinning. On a
# machine shared with other processes, spinning workers take the cores that the working threads
# need, which costs a short kernel far more than a long one. All implementations compared here
# run on that pool. --spin keeps OpenMP's default.
if "--spin" not in sys.argv:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from local_attn_fairseq.ops import banded_attention, extension_info  # noqa: E402

MiB = 2**20


def band_mask(length, left, right):
    offset = torch.arange(length)[None, :] - torch.arange(length)[:, None]
    return (offset >= -left) & (offset <= right)


def naive_attention(q, k, v, mask):
    logits = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1) @ v


IMPLEMENTATIONS = ("banded", "sdpa", "naive", "global")


def make_runners(length, width, device):
    """name -> (callable(q, k, v) -> out, resident bytes it needs besides its own allocations)."""
    half = (width - 1) // 2
    mask = band_mask(length, half, half).to(device)
    sdpa = F.scaled_dot_product_attention
    return {
        "banded": (lambda q, k, v: banded_attention(q, k, v, half, half), 0),
        "sdpa": (lambda q, k, v: sdpa(q, k, v, attn_mask=mask), mask.nbytes),
        "naive": (lambda q, k, v: naive_attention(q, k, v, mask), mask.nbytes),
        "global": (lambda q, k, v: sdpa(q, k, v), 0),
    }


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_call(fn, inputs, backward):
    if not backward:
        with torch.no_grad():
            fn(*inputs)
        return
    out = fn(*inputs)
    out.backward(torch.ones_like(out))
    for t in inputs:
        t.grad = None


def timed(fn, inputs, backward):
    device = inputs[0].device if inputs else torch.device("cpu")
    synchronize(device)
    start = time.perf_counter()
    one_call(fn, inputs, backward)
    synchronize(device)
    return time.perf_counter() - start


def peak_bytes(fn, inputs, backward):
    """Peak of torch's allocations during one call, above what was live before it."""
    device = inputs[0].device
    if device.type == "cuda":
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        one_call(fn, inputs, backward)
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        one_call(fn, inputs, backward)
    # The raw allocation events (+bytes, -bytes on free), in time order, CPU only.
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    live = peak = 0
    for _, change in events:
        live += change
        peak = max(peak, live)
    return peak


def matmul_peak_gflops(device, dtype, repeats=5):
    size = 8192 if device.type == "cuda" else 2048
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    a @ b
    best = min(timed(lambda *_: a @ b, (a,), False) for _ in range(repeats))
    return 2 * size**3 / best / 1e9


def dense_fits(batch, heads, length, budget_bytes):
    # naive keeps logits, probabilities and their gradients: about 3 (B, H, T, T) float32 tensors
    return 3 * batch * heads * length * length * 4 <= budget_bytes


def measure(args, length, width, backward):
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, length, args.dim)
    inputs = [
        torch.randn(shape, generator=gen).to(args.device, args.dtype).requires_grad_(backward)
        for _ in range(3)
    ]
    runners = make_runners(length, width, args.device)
    if not dense_fits(args.batch, args.heads, length, args.dense_memory_gb * 2**30):
        # flash attention needs no T x T memory: global attention stays on a GPU
        keep = ("banded", "global") if args.device.type == "cuda" else ("banded",)
        runners = {name: runners[name] for name in keep}
    times = {name: [] for name in runners}
    for name, (fn, _) in runners.items():  # warm-up
        one_call(fn, inputs, backward)
    for _ in range(args.repeats):
        for name, (fn, _) in runners.items():
            times[name].append(timed(fn, inputs, backward))
    memory = {
        name: peak_bytes(fn, inputs, backward) + extra for name, (fn, extra) in runners.items()
    }
    # What every implementation allocates alike: the output, and with backward also the seed
    # gradient and the three input gradients.
    returned = inputs[0].nbytes * (5 if backward else 1)
    return {name: (statistics.median(times[name]), memory[name], returned) for name in runners}


def format_row(length, width, mode, result, flops, peak_gflops):
    banded_time, banded_mem, _ = result["banded"]
    cells = [str(length), str(width), mode]
    for name in IMPLEMENTATIONS:
        cells.append(f"{result[name][0] * 1e3:.2f}" if name in result else "skipped")
    for name in IMPLEMENTATIONS[1:]:
        cells.append(f"{result[name][0] / banded_time:.1f}x" if name in result else "-")
    for name in IMPLEMENTATIONS:
        cells.append(f"{result[name][1] / MiB:.1f}" if name in result else "skipped")
    cells.append(f"{result['sdpa'][1] / banded_mem:.1f}x" if "sdpa" in result else "-")
    returned = result["banded"][2]
    working = {name: max(result[name][1] - returned, 1) for name in result}
    cells.append(f"{working['sdpa'] / working['banded']:.0f}x" if "sdpa" in result else "-")
    gflops = flops / banded_time / 1e9
    cells += [f"{gflops:.1f}", f"{100 * gflops / peak_gflops:.0f}%"]
    return "| " + " | ".join(cells) + " |"


HEADER = [
    "T", "w", "mode", "banded ms", "sdpa ms", "naive ms", "global ms", "sdpa/banded",
    "naive/banded", "global/banded", "banded MiB", "sdpa MiB", "naive MiB", "global MiB",
    "sdpa/banded mem", "sdpa/banded mem beyond outputs", "banded GFLOP/s", "of peak",
]  # fmt: skip


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="T in {256, 1024}, w in {5, 65}, 2 rounds"
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument("--widths", type=int, nargs="+", default=[5, 33, 65, 129])
    parser.add_argument(
        "--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"]
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dense-memory-gb", type=float, default=6.0)
    parser.add_argument("--impl", choices=["extension", "torch"], default="extension")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"]
    )
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--spin", action="store_true", help="keep OpenMP's spinning idle workers")
    parser.add_argument("--output", help="also write the table (markdown) to this file")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.widths, args.repeats = [256, 1024], [5, 65], 2
    args.device, args.dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    return args  # fmt: skip


def main():
    args = parse_args()
    os.environ["LOCAL_ATTN_BANDED_IMPL"] = args.impl
    if args.threads:
        torch.set_num_threads(args.threads)
    peak = matmul_peak_gflops(args.device, args.dtype)
    info = extension_info()
    if args.device.type == "cuda":
        where = torch.cuda.get_device_name(args.device)
    else:
        where = f"CPU, {torch.get_num_threads()} threads, OMP_WAIT_POLICY=" + os.environ.get(
            "OMP_WAIT_POLICY", "default"
        )
    dtype = str(args.dtype).replace("torch.", "")
    lines = [
        f"banded implementation: {args.impl} {info}; torch {torch.__version__}; {where}; "
        f"B={args.batch} H={args.heads} D={args.dim} {dtype}; "
        f"peak ({dtype} matmul) {peak:.0f} GFLOP/s; times: median of {args.repeats} rounds",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    print("\n".join(lines), flush=True)
    for length in args.lengths:
        for width in args.widths:
            for mode in args.modes:
                backward = mode == "fwd+bwd"
                result = measure(args, length, width, backward)
                band_flops = 4 * args.batch * args.heads * length * width * args.dim
                flops = band_flops * (3 if backward else 1)
                lines.append(format_row(length, width, mode, result, flops, peak))
                print(lines[-1], flush=True)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
