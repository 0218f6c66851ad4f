#!/usr/bin/env python3
"""What Pande's post-softmax band masks cost in one attention layer, side by side.

    python benchmarks/pande_masks.py [--lengths 2000 4000 8000] [--heads 8] [--embed-dim 512]

One ``LocalMultiheadAttention`` self-attention layer (encoder: no causal mask), batch 1, float32,
forward + backward, every head of the same kind:

  band-8           Pande's band-8 mask: the band of the full softmax from the banded operator
                   and the log-sum-exp over all keys (the default path);
  band-8-explicit  the same function through the T x T softmax and the 0/1 mask
                   (``banded_kernel=False``), skipped where its T x T tensors would exceed
                   --explicit-limit-gb;
  local-8          local attention renormalised in the window i-8 .. i+8 (the banded operator);
  global           no mask (PyTorch's scaled_dot_product_attention).

Each case runs in a fresh subprocess: peak memory is the growth of the process's maximum
resident set (``resource.getrusage``) over one forward + backward, after a warm-up on a short
sequence; times are medians over --repeats forward + backward passes, wall-clock and CPU time
(all threads; steadier than wall-clock on a machine shared with other processes). Ratios are
taken between cases of the same run.

    python benchmarks/pande_masks.py --short-sequences [--lengths 8 16 32 48 64 128]

The other side: sentence-length sequences, where the T x T matrices are small. One layer of
``transformer_local_tied`` (Pande et al. config (i), every head a mask, Wq/Wk tied), batches of
--batch-tokens tokens, dropout 0.1, forward + backward, both paths timed in turns in one process:
the band path and the explicit one. A layer takes the band path from
``PANDE_BAND_MIN_KEYS`` keys on (``modules/attention_plan.py``); the last column says which path
it takes at each length.

    python benchmarks/pande_masks.py --short-sequences --mixed

The same for a layer of local heads beside global heads (six ``local-8`` heads and two global
ones, no Pande's masks): its by-kind path (one banded call, one fused call) against the explicit
one; it takes the by-kind path from ``LOCAL_BESIDE_GLOBAL_MIN_KEYS`` keys on.
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from local_attn_fairseq.cli_types import positive_int
from local_attn_fairseq.locality.spec import HeadSpec, LocalitySpec
from local_attn_fairseq.modules import attention_plan
from local_attn_fairseq.modules.local_multihead_attention import LocalMultiheadAttention

CASES = {  # name: (mask of every head, banded_kernel)
    "band-8": ("band-8", True),
    "band-8-explicit": ("band-8", False),
    "local-8": ("local-8", True),
    "global": ("global", True),
}
# T x T float32 tensors the explicit path keeps at its peak (logits, probabilities, the masked
# probabilities and their gradients): about 4.2 of them measured at T = 2000.
EXPLICIT_MATRICES = 4.5
MiB = 2**20
SHORT_LENGTHS = [8, 16, 32, 48, 64, 128]  # --short-sequences: sentence lengths in tokens


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def forward_backward(attn, x):
    """Wall-clock and CPU seconds (all threads) of one forward + backward."""
    wall, cpu = time.perf_counter(), time.process_time()
    out, _ = attn(x, x, x, need_weights=False)
    out.sum().backward()
    elapsed = (time.perf_counter() - wall, time.process_time() - cpu)
    x.grad = None
    attn.zero_grad(set_to_none=True)
    return elapsed


def run_case(case: str, length: int, heads: int, embed_dim: int, batch: int, repeats: int):
    """Memory and time of one case, measured in this process (a fresh one per case)."""
    mask, banded = CASES[case]
    torch.manual_seed(0)
    attn = LocalMultiheadAttention(
        embed_dim, heads, head_specs=[HeadSpec(mask)] * heads, self_attention=True,
        banded_kernel=banded,
    ).train()  # fmt: skip
    x = torch.randn(length, batch, embed_dim, requires_grad=True)
    forward_backward(attn, x[:64].detach().requires_grad_())  # loads kernels, thread pools
    before = max_rss_bytes()
    times = [forward_backward(attn, x) for _ in range(repeats)]
    return {
        "peak_mib": (max_rss_bytes() - before) / MiB,
        "seconds": statistics.median(wall for wall, _ in times),
        "cpu_seconds": statistics.median(cpu for _, cpu in times),
    }


def measure_in_subprocess(case: str, length: int, args) -> dict:
    command = [
        sys.executable, __file__, "--run-case", case, "--lengths", str(length),
        "--heads", str(args.heads), "--embed-dim", str(args.embed_dim),
        "--batch", str(args.batch), "--repeats", str(args.repeats),
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{case} at T = {length} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def explicit_fits(length: int, args) -> bool:
    need = EXPLICIT_MATRICES * args.batch * args.heads * length * length * 4
    return need <= args.explicit_limit_gb * 2**30


def ratio(numerator, denominator) -> str:
    return f"{numerator / denominator:.2f}x" if numerator is not None and denominator else "-"


def print_table(results, lengths, cases):
    print(
        "| T | case | peak MiB | fwd+bwd s | CPU s | memory / local-8 "
        "| time / band-8-explicit | CPU time / band-8-explicit |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for length in lengths:
        row = results[length]
        local = row.get("local-8", {}).get("peak_mib")
        explicit = row.get("band-8-explicit", {})
        for case in cases:
            if case not in row:
                print(f"| {length} | {case} | skipped | skipped | skipped | - | - | - |")
                continue
            peak, wall, cpu = (row[case][key] for key in ("peak_mib", "seconds", "cpu_seconds"))
            print(
                f"| {length} | {case} | {peak:.0f} | {wall:.2f} | {cpu:.2f} | {ratio(peak, local)} "
                f"| {ratio(wall, explicit.get('seconds'))} "
                f"| {ratio(cpu, explicit.get('cpu_seconds'))} |"
            )


def config_i_layer(embed_dim, heads):
    """Layer 0 of Pande et al.'s config (i) (``transformer_local_tied``'s encoder), its ties bound."""
    spec = LocalitySpec("1loc7tied-all6", {"encoder_self": 1}, {"encoder_self": heads})
    specs = spec.heads("encoder_self", 0)
    torch.manual_seed(0)
    attn = LocalMultiheadAttention(
        embed_dim, heads, head_specs=specs, self_attention=True, dropout=0.1
    )
    attn.bind_qk_owners([attn])
    return attn.train()


def local_beside_global_layer(embed_dim, heads):
    """Local heads with two global ones, as the mixed layers of a long-context LM have them."""
    specs = [HeadSpec("global")] * 2 + [HeadSpec("local-8")] * (heads - 2)
    torch.manual_seed(0)
    attn = LocalMultiheadAttention(
        embed_dim, heads, head_specs=specs, self_attention=True, dropout=0.1
    )
    attn.bind_qk_owners([attn])
    return attn.train()


def short_sequences(args):
    """By-kind path against the explicit one at sentence lengths, timed in turns in this process."""
    if args.mixed:
        attn, name, threshold = local_beside_global_layer(
            args.embed_dim, args.heads
        ), "2 global + local-8", "LOCAL_BESIDE_GLOBAL_MIN_KEYS"
    else:
        attn, name, threshold = config_i_layer(
            args.embed_dim, args.heads
        ), "config (i)", "PANDE_BAND_MIN_KEYS"
    default_threshold = getattr(attention_plan, threshold)
    print(
        f"{name} layer, {args.heads} heads, embed {args.embed_dim}, {args.batch_tokens} "
        f"tokens a batch, float32, forward + backward, {torch.get_num_threads()} threads"
    )
    print("| T | batch | by-kind path ms | explicit ms | explicit / by-kind | default path |")
    print("|---|---|---|---|---|---|")
    try:
        setattr(attention_plan, threshold, 0)
        for length in args.lengths:
            batch = max(1, args.batch_tokens // length)
            x = torch.randn(length, batch, args.embed_dim, requires_grad=True)
            times = {True: [], False: []}
            for _ in range(args.repeats + 2):  # the first two passes of each path warm up
                for band in (True, False):
                    attn.banded_kernel = band
                    times[band].append(forward_backward(attn, x)[0])
            band, explicit = (statistics.median(times[b][2:]) for b in (True, False))
            default = "by-kind" if length >= default_threshold else "explicit"
            print(
                f"| {length} | {batch} | {band * 1e3:.1f} | {explicit * 1e3:.1f} "
                f"| {explicit / band:.2f}x | {default} |"
            )
    finally:
        setattr(attention_plan, threshold, default_threshold)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=positive_int, nargs="+", default=[2000, 4000, 8000])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--heads", type=positive_int, default=8)
    parser.add_argument("--embed-dim", type=positive_int, default=512)
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed passes per case")
    parser.add_argument(
        "--explicit-limit-gb", type=float, default=8.0,
        help="skip the explicit path where its T x T tensors would exceed this",
    )  # fmt: skip
    parser.add_argument(
        "--short-sequences", action="store_true",
        help="sentence lengths instead: a config (i) layer, band path vs explicit path",
    )  # fmt: skip
    parser.add_argument(
        "--mixed", action="store_true",
        help="--short-sequences: a layer of local heads beside global ones instead of config (i)",
    )  # fmt: skip
    parser.add_argument(
        "--batch-tokens",
        type=positive_int,
        default=2048,
        help="--short-sequences: tokens per batch",
    )
    parser.add_argument("--run-case", choices=sorted(CASES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.embed_dim % args.heads:
        parser.error("--embed-dim must be a positive multiple of --heads")
    if args.short_sequences:
        if args.lengths == parser.get_default("lengths"):
            args.lengths = SHORT_LENGTHS
        args.embed_dim = 128 if args.embed_dim == parser.get_default("embed_dim") else args.embed_dim
        args.repeats = max(args.repeats, 5)
        short_sequences(args)
        return
    if args.run_case:  # the child process of one measurement
        result = run_case(
            args.run_case, args.lengths[0], args.heads, args.embed_dim, args.batch, args.repeats
        )
        print(json.dumps(result))
        return
    print(
        f"one self-attention layer, {args.heads} heads, embed {args.embed_dim}, "
        f"B = {args.batch}, float32, forward + backward, {torch.get_num_threads()} threads"
    )
    results = {}
    for length in args.lengths:
        results[length] = {}
        for case in args.cases:
            if case == "band-8-explicit" and not explicit_fits(length, args):
                continue
            results[length][case] = measure_in_subprocess(case, length, args)
            print(f"  T = {length} {case}: {results[length][case]}", file=sys.stderr)
    print_table(results, args.lengths, args.cases)


if __name__ == "__main__":
    main()
