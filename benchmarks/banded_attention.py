#!/usr/bin/env python3
"""The banded attention routes against what a user would otherwise write, on CPU or GPU.

    python benchmarks/banded_attention.py [--quick] [--lengths 256 1024] [--widths 5 65]
    python benchmarks/banded_attention.py --device cuda --dtype bfloat16 --batch 8 --heads 8
    python benchmarks/banded_attention.py --quick --json results.json   # the table and its records

Compared, for each sequence length T and band width w = left + right + 1 (left = right):
  banded  ``local_attn_fairseq.ops.banded_attention`` on the route of ``--impl`` (the compiled
          kernels by default; ``torch`` is the pure-PyTorch fallback, ``tensor-core`` the
          tensor-core kernel);
  tensor-core, flash-window, cudnn-band  the same function on the tensor-core kernel, torch's
          windowed FlashAttention-2 kernels and cuDNN's band, beside the ``banded`` row on a GPU
          (each where the route table and its adapter take the call; else the row says why);
  blocked the same function on its blocked-SDPA route (``LOCAL_ATTN_BANDED_IMPL=sdpa``);
  flex    ``torch.nn.attention.flex_attention`` with a sliding-window ``create_block_mask``,
          compiled with ``torch.compile`` (no backward on the CPU: forward only there; a
          compilation that fails is reported in its cell);
  sdpa    ``torch.nn.functional.scaled_dot_product_attention`` with a boolean (T, T) band mask;
  naive   matmul, masked_fill, softmax, matmul;
  global  scaled_dot_product_attention without a mask: the global attention that a local layer
          replaces (on a GPU, PyTorch's flash kernel), for scale;
in two modes: forward only (under no_grad) and forward + backward.

Time: the median of --repeats rounds, the implementations alternating within each round, so
that load from other processes on a shared machine hits them alike. Memory: the peak of the
bytes torch allocates during one call (outputs, gradients, saved and temporary tensors), read
from the allocation events of torch's profiler (``profile_memory=True``) on the CPU and from
the caching allocator's peak statistic on the GPU, plus, for the dense implementations, the
(T, T) mask they need resident. Masks are built outside the timed region (a model would build
them once). "beyond outputs" leaves out what every implementation allocates alike (the output,
and for forward + backward the seed gradient and the three input gradients). Band TFLOP/s
counts the useful band work of every route alike: 4 * B * H * T * w * D forward (w clipped to
T), and 3x that for forward + backward (backward = 2x forward; FlashAttention's papers count
2.5x, which would scale every fwd+bwd figure by 3.5 / 3), against the device's matmul peak,
estimated by timing a large matmul of the same dtype in the same run. Dense implementations are
skipped where their T x T tensors would exceed --dense-memory-gb.

--json FILE writes the same measurements as data: a JSON list of one object per row of the
table (each route of each (T, w, mode) cell, a route that could not run with its note), replaced
atomically after every cell so that a run cut short keeps what it measured. Each record holds
the machine ("gpu": the GPU's name, or the CPU and its threads), the torch version, the date
(ISO, UTC), dtype, B, H, D, T, w, mode, route, the median ms, the band FLOPs and TFLOP/s above,
the HBM bytes and GB/s, peak MiB, the speed-ups, and "note" (null for a measured route, the
reason otherwise). HBM bytes are the fewest a call must move, whatever the route: forward reads
q, k, v and writes out (4 * B * H * T * D elements) and the float32 row log-sum-exp
(B * H * T * 4 bytes); forward + backward adds reading q, k, v, out, grad_out and the
log-sum-exp and writing dq, dk, dv. GB/s is therefore a lower bound of what a route moved.
"""

import argparse
import datetime
import json
import logging
import os
import statistics
import sys

# Before torch starts its OpenMP pool: idle workers then wait passively instead of spinning. On a
# machine shared with other processes, spinning workers take the cores that the working threads
# need, which costs a short kernel far more than a long one. All implementations compared here
# run on that pool. --spin keeps OpenMP's default.
if "--spin" not in sys.argv:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from local_attn_fairseq.cli_types import output_file, positive_int  # noqa: E402
from local_attn_fairseq.experiments.measurement import (  # noqa: E402
    add_overwrite_option,
    attention_traffic_bytes,
    band_flops,
    check_output_file,
    one_call,
    peak_bytes,
    timed,
    write_output_file,
)
from local_attn_fairseq.ops import (  # noqa: E402
    banded_attention,
    extension_info,
    unsupported_reasons,
)

IMPL_ENV = "LOCAL_ATTN_BANDED_IMPL"
MiB = 2**20


def band_mask(length, left, right):
    offset = torch.arange(length)[None, :] - torch.arange(length)[:, None]
    return (offset >= -left) & (offset <= right)


def naive_attention(q, k, v, mask):
    logits = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1) @ v


# The operator's GPU routes timed beside the "banded" row (forced by LOCAL_ATTN_BANDED_IMPL).
GPU_ROUTES = ("tensor-core", "flash-window", "cudnn-band")
IMPLEMENTATIONS = ("banded", *GPU_ROUTES, "blocked", "flex", "sdpa", "naive", "global")
DENSE = ("sdpa", "naive")


def on_route(route, half):
    """banded_attention on one route (the variable is read at every call)."""

    def run(q, k, v):
        os.environ[IMPL_ENV] = route
        return banded_attention(q, k, v, half, half)

    return run


def flex_runner(length, half, device):
    """Compiled FlexAttention with a sliding-window block mask, or the reason it cannot run."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as error:
        return None, f"unavailable: {error}"

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= half) & (kv_idx - q_idx <= half)

    block_mask = create_block_mask(sliding_window, None, None, length, length, device=str(device))
    # Every (T, w, mode) cell compiles anew; past dynamo's default of 8 recompilations it would
    # silently run flex_attention eagerly (the dense T x T path) and time that instead.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    compiled = torch.compile(flex_attention)
    return (lambda q, k, v: compiled(q, k, v, block_mask=block_mask)), None


def gpu_route_gap(route, args, inputs, half):
    """Why a GPU route's row has no figure (None when it has one): the route table's and its
    adapter's reasons for this call."""
    if args.impl == route:
        return "the banded row"
    reasons = unsupported_reasons(route, *inputs, half, half)
    return "; ".join(reasons).replace("|", "/") if reasons else None


def make_runners(length, width, args, backward, inputs):
    """name -> (callable(q, k, v) -> out, resident bytes besides its own allocations), and
    name -> why a route has no figure."""
    device, impl = args.device, args.impl
    half = (width - 1) // 2
    mask = band_mask(length, half, half).to(device)
    sdpa = F.scaled_dot_product_attention
    runners = {
        "banded": (on_route(impl, half), 0),
        "blocked": (on_route("sdpa", half), 0),
        "sdpa": (lambda q, k, v: sdpa(q, k, v, attn_mask=mask), mask.nbytes),
        "naive": (lambda q, k, v: naive_attention(q, k, v, mask), mask.nbytes),
        "global": (lambda q, k, v: sdpa(q, k, v), 0),
    }
    notes = {}
    for route in GPU_ROUTES if device.type == "cuda" else ():  # no rows on the CPU
        gap = gpu_route_gap(route, args, inputs, half)
        if gap is None:
            runners[route] = (on_route(route, half), 0)
        else:
            notes[route] = gap
    if backward and device.type == "cpu":
        notes["flex"] = "no CPU backward"
    else:
        flex, why = flex_runner(length, half, device)
        if flex is None:
            notes["flex"] = why
        else:
            runners["flex"] = (flex, 0)
    return runners, notes


def matmul_peak_gflops(device, dtype, repeats=5):
    size = 8192 if device.type == "cuda" else 2048
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    a @ b
    best = min(timed(lambda *_: a @ b, (a,), False) for _ in range(repeats))
    return 2 * size**3 / best / 1e9


def dense_fits(batch, heads, length, budget_bytes):
    # naive keeps logits, probabilities and their gradients: about 3 (B, H, T, T) float32 tensors
    return 3 * batch * heads * length * length * 4 <= budget_bytes


def _short(error: BaseException) -> str:
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"failed: {type(error).__name__}: {first[:150]}".replace("|", "/")


def measure(args, length, width, backward):
    """name -> (median seconds, peak bytes, bytes every route returns) or a note string."""
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, length, args.dim)
    inputs = [
        torch.randn(shape, generator=gen).to(args.device, args.dtype).requires_grad_(backward)
        for _ in range(3)
    ]
    runners, notes = make_runners(length, width, args, backward, inputs)
    if not dense_fits(args.batch, args.heads, length, args.dense_memory_gb * 2**30):
        for name in DENSE:
            del runners[name]
            notes[name] = "skipped (T x T memory)"
        if args.device.type != "cuda":  # flash attention needs no T x T memory on a GPU
            del runners["global"]
            notes["global"] = "skipped (T x T memory)"
    for name, (fn, _) in list(runners.items()):  # warm-up (and compilation), not timed
        try:
            one_call(fn, inputs, backward)
        except Exception as error:  # a route that cannot run here is reported, not fatal
            notes[name] = _short(error)
            del runners[name]
    times = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, (fn, _) in runners.items():
            times[name].append(timed(fn, inputs, backward))
    # What every implementation allocates alike: the output, and with backward also the seed
    # gradient and the three input gradients.
    returned = inputs[0].nbytes * (5 if backward else 1)
    result = dict(notes)
    for name, (fn, extra) in runners.items():
        memory = peak_bytes(fn, inputs, backward) + extra
        result[name] = (statistics.median(times[name]), memory, returned)
    return result


def cell_records(run, length, width, mode, result):
    """One record per route of a (T, w, mode) cell, in table order: the fields of `run` (machine,
    versions, shape, dtype), the cell, and the route's figures, or null figures and its note."""
    backward = mode == "fwd+bwd"
    batch, heads, dim = run["B"], run["H"], run["D"]
    flops = band_flops(batch, heads, length, width, dim, backward)
    element_size = getattr(torch, run["dtype"]).itemsize
    traffic = attention_traffic_bytes(batch, heads, length, dim, element_size, backward)

    def seconds_of(name):
        value = result.get(name)
        return value[0] if isinstance(value, tuple) else None

    banded, glob = seconds_of("banded"), seconds_of("global")
    records = []
    for name in filter(result.__contains__, IMPLEMENTATIONS):
        record = dict(run, T=length, w=width, mode=mode, route=name)
        record.update(band_flops=flops, hbm_bytes=traffic)
        value = result[name]
        if isinstance(value, tuple):
            seconds, memory, returned = value
            record.update(
                ms=seconds * 1e3,
                band_tflops=flops / seconds / 1e12,
                hbm_gbps=traffic / seconds / 1e9,
                peak_mib=memory / MiB,
                mib_beyond_outputs=max(memory - returned, 0) / MiB,
                speedup_vs_banded=None if banded is None else banded / seconds,
                speedup_vs_global=None if glob is None else glob / seconds,
                note=None,
            )
        else:
            figures = ("ms", "band_tflops", "hbm_gbps", "peak_mib", "mib_beyond_outputs")
            record.update(dict.fromkeys(figures + ("speedup_vs_banded", "speedup_vs_global")))
            record["note"] = value
        records.append(record)
    return records


def format_rows(records):
    """One table row per record: time, speed-ups, memory, band TFLOP/s (or why it is missing)."""

    def speedup(ratio):
        return "-" if ratio is None else f"{ratio:.2f}x"

    rows = []
    for r in records:
        cells = [str(r["T"]), str(r["w"]), r["mode"], r["route"]]
        if r["ms"] is None:
            cells += [r["note"] or "-"] + ["-"] * 6
        else:
            cells += [
                f"{r['ms']:.2f}",
                speedup(r["speedup_vs_banded"]),
                speedup(r["speedup_vs_global"]),
                f"{r['peak_mib']:.1f}",
                f"{r['mib_beyond_outputs']:.1f}",
                f"{r['band_tflops']:.3g}",
                f"{100 * r['band_tflops'] / r['matmul_peak_tflops']:.1f}%",
            ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


HEADER = [
    "T", "w", "mode", "route", "ms", "speed vs banded", "speed vs global", "peak MiB",
    "MiB beyond outputs", "band TFLOP/s", "of peak",
]  # fmt: skip


# The first words of the table --output holds: an existing file that begins so is this
# benchmark's, replaced by a new run; any other needs --overwrite.
TABLE_START = "banded route: "


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="T in {256, 1024}, w in {5, 65}, 2 rounds"
    )
    parser.add_argument("--lengths", type=positive_int, nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument("--widths", type=positive_int, nargs="+", default=[5, 33, 65, 129])
    parser.add_argument(
        "--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"]
    )
    parser.add_argument(
        "--backward", action="store_true", help="forward + backward only (--modes fwd+bwd)"
    )
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--heads", type=positive_int, default=4)
    parser.add_argument("--dim", type=positive_int, default=64)
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--dense-memory-gb", type=float, default=6.0)
    parser.add_argument(
        "--impl", choices=["extension", "torch", *GPU_ROUTES], default="extension",
        help="the route of the 'banded' rows",
    )  # fmt: skip
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"]
    )
    parser.add_argument(
        "--threads", type=positive_int, help="torch intra-op threads (default: torch's)"
    )
    parser.add_argument("--spin", action="store_true", help="keep OpenMP's spinning idle workers")
    parser.add_argument(
        "--output", type=output_file, help="also write the table (markdown) to this file"
    )
    parser.add_argument(
        "--json", metavar="FILE", type=output_file,
        help="also write one record per route and cell to this file (a JSON list)",
    )  # fmt: skip
    add_overwrite_option(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.widths, args.repeats = [256, 1024], [5, 65], 2
    if args.backward:
        args.modes = ["fwd+bwd"]
    if any(w < 1 or w % 2 == 0 for w in args.widths):
        parser.error("--widths: odd band widths w = 2 * half + 1 >= 1")
    args.device, args.dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    if args.dense_memory_gb < 0:
        parser.error("--dense-memory-gb: must be 0 or more")
    if args.output and args.json and os.path.abspath(args.output) == os.path.abspath(args.json):
        parser.error("--output and --json name the same file; give each its own")
    if args.output:
        check_output_file(args.output, "--output", args.overwrite)
    if args.json:  # rewritten after every cell, so that a run cut short keeps its records
        check_output_file(args.json, "--json", args.overwrite)
    return args


def main(argv=None):
    args = parse_args(argv)
    logging.getLogger("filelock").setLevel(logging.WARNING)  # torch.compile's cache locks
    if args.threads:
        torch.set_num_threads(args.threads)
    peak = matmul_peak_gflops(args.device, args.dtype) / 1e3
    info = extension_info()
    if args.device.type == "cuda":
        where = torch.cuda.get_device_name(args.device)
    else:
        where = f"CPU, {torch.get_num_threads()} threads, OMP_WAIT_POLICY=" + os.environ.get(
            "OMP_WAIT_POLICY", "default"
        )
    dtype = str(args.dtype).replace("torch.", "")
    lines = [
        f"{TABLE_START}{args.impl} {info}; torch {torch.__version__}; {where}; "
        f"B={args.batch} H={args.heads} D={args.dim} {dtype}; "
        f"peak ({dtype} matmul) {peak:.3f} TFLOP/s; times: median of {args.repeats} rounds; "
        "band FLOPs: 4*B*H*T*w*D forward, 3x with backward",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    print("\n".join(lines), flush=True)
    run = {
        "gpu": where,
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dtype": dtype,
        "banded_impl": args.impl,
        "repeats": args.repeats,
        "matmul_peak_tflops": peak,
        "B": args.batch,
        "H": args.heads,
        "D": args.dim,
    }
    records = []
    for length in args.lengths:
        for width in args.widths:
            for mode in args.modes:
                result = measure(args, length, width, mode == "fwd+bwd")
                cell = cell_records(run, length, width, mode, result)
                rows = format_rows(cell)
                lines += rows
                print("\n".join(rows), flush=True)
                records += cell
                if args.json:
                    write_output_file(args.json, "--json", json.dumps(records, indent=1) + "\n")
    if args.output:
        write_output_file(args.output, "--output", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
