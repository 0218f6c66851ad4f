"""What one call costs at tiny shapes: the plugin's attention against its peer, side by side.

At translation and speech lengths a call's fixed cost (Python, argument checks, autograd
bookkeeping, kernel launches, host synchronisations) outweighs its arithmetic, so each row times
one forward + backward of one of the plugin's calls and of the call a user would compare it with,
on the same inputs:

* ``banded``: ``ops.banded_attention`` against PyTorch's ``scaled_dot_product_attention``
  (unmasked, as a user would compare them);
* every other row: the encoder self-attention module of a one-layer plugin model, built by
  fairseq's argument parsing and the plugin's model classes exactly as fairseq-train builds it,
  against fairseq's own ``MultiheadAttention`` taken from fairseq's ``transformer`` of the same
  sizes, called the way fairseq's encoder layer calls them.

The machine may be shared and noisy: the two sides of a row run in alternating rounds, and the
ratio of their medians is what counts. The targets are the issue's: what each mechanism may cost
per call beyond its peer.
"""

import statistics
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from fairseq import options as fairseq_options
from fairseq import tasks
from torch import Tensor, nn

from ..modules import head_pruning
from ..ops.banded_attention import banded_attention
from .measurement import (
    DictionaryFolder,
    ForwardBackward,
    alternating_rounds,
    device_seconds_per_call,
    host_seconds_per_call,
    operations_per_call,
)

# the banded operator's row
BANDED_SHAPE = (1, 2, 16, 16)  # B, H, T, D
BANDED_WINDOW = 2  # keys on each side
# the modules' rows: fairseq's (T, B, C) layout
LENGTH, BATCH, EMBED_DIM, HEADS = 8, 2, 64, 8
# The pruned row keeps 2 of 8 heads (3/4 pruned, as in Voita et al.'s sparse WMT model and
# benchmarks/head_pruning.py); the other gates are closed before pruning.
PRUNED_KEPT_HEADS = (2, 5)
CLOSED_LOG_ALPHA = -5.0  # far below a gate's open threshold (about 0.6 at temperature 2/3)

MODEL_DIMS = [
    "--encoder-layers", "1", "--decoder-layers", "1",
    "--encoder-embed-dim", str(EMBED_DIM), "--decoder-embed-dim", str(EMBED_DIM),
    "--encoder-ffn-embed-dim", str(2 * EMBED_DIM), "--decoder-ffn-embed-dim", str(2 * EMBED_DIM),
    "--encoder-attention-heads", str(HEADS), "--decoder-attention-heads", str(HEADS),
]  # fmt: skip
LOCAL_K = "{encoder_self: {all: [" + ", ".join([f"local-{BANDED_WINDOW}"] * HEADS) + "]}}"


@dataclass(frozen=True)
class RowKind:
    name: str  # what --only selects
    ours: str
    peer: str
    target: float  # the most ours may cost per call, as a multiple of the peer's cost
    arch: Optional[str] = None  # the plugin model whose encoder self-attention is timed
    options: Tuple[str, ...] = ()


FAIRSEQ_MHA = "fairseq MultiheadAttention"
MODULE_SIZES = f"T={LENGTH} B={BATCH} C={EMBED_DIM}, {HEADS} heads"
ROW_KINDS = (
    RowKind(
        "banded",
        "banded_attention (B=1 H=2 T=16 D=16, window 2+2)",
        "scaled_dot_product_attention (no mask)",
        1.2,
    ),
    RowKind(
        "local-k",
        f"local-K: every head local-{BANDED_WINDOW}, banded ({MODULE_SIZES})",
        FAIRSEQ_MHA,
        1.1,
        "transformer_local",
        ("--locality-config", LOCAL_K),
    ),
    RowKind(
        "pande",
        f"Pande: tied fixed masks, 1loc7tied-all6 ({MODULE_SIZES})",
        FAIRSEQ_MHA,
        1.1,
        "transformer_local_tied",
    ),
    RowKind(
        "gaussian",
        f"Yang: Gaussian localness ({MODULE_SIZES})",
        FAIRSEQ_MHA,
        1.3,
        "transformer_localness",
        # the arch's layers 0-2, cut to the one layer built here
        ("--localness-layers", "encoder_self:0"),
    ),
    RowKind(
        "mw",
        f"Nguyen: dynamic window MW ({MODULE_SIZES})",
        FAIRSEQ_MHA,
        1.6,
        "transformer_dynwin",
        ("--dynamic-window", "encoder_self:mw:0"),
    ),
    RowKind(
        "aw",
        f"Nguyen: dynamic window AW ({MODULE_SIZES})",
        FAIRSEQ_MHA,
        1.6,
        "transformer_dynwin",
    ),
    RowKind(
        "gates",
        f"Voita: Hard Concrete head gates, training ({MODULE_SIZES})",
        FAIRSEQ_MHA,
        1.3,
        "transformer_local",
        ("--head-gates", "enc"),
    ),
    RowKind(
        "pruned",
        f"pruned: {len(PRUNED_KEPT_HEADS)} of {HEADS} heads kept ({MODULE_SIZES})",
        FAIRSEQ_MHA,
        1.1,
        "transformer_local",
        ("--head-gates", "enc"),  # the gated model that is pruned
    ),
)
ROW_NAMES = tuple(kind.name for kind in ROW_KINDS)


@dataclass
class Contender:
    """One side of a row: ``forward()`` is the timed forward pass, ``leaves`` the tensors whose
    gradients a call leaves behind, ``module`` the attention module (None for the operators)."""

    forward: Callable[[], Tensor]
    leaves: Sequence[Tensor]
    module: Optional[nn.Module] = None

    def training_call(self) -> ForwardBackward:
        return ForwardBackward(self.forward, self.leaves)


@dataclass
class Row:
    kind: RowKind
    ours: Contender
    peer: Contender


# -- building the rows -------------------------------------------------------------------------


class ModelBuilder(DictionaryFolder):
    """Models of the translation task built by fairseq's own argument parsing, as fairseq-train
    builds them; the task needs nothing but two small dictionaries."""

    def __init__(self):
        super().__init__("host_overhead_", ("src", "tgt"))

    def build(self, arch: str, options: Sequence[str] = ()):
        """(model, its parsed arguments, task)."""
        parser = fairseq_options.get_training_parser()
        command = [self.path, "-s", "src", "-t", "tgt", "--arch", arch, *MODEL_DIMS]
        args = fairseq_options.parse_args_and_arch(parser, [*command, *options])
        task = tasks.setup_task(args)
        return task.build_model(args), args, task


def encoder_self_attention(model) -> nn.Module:
    return model.encoder.layers[0].self_attn


def pruned_model(gated, args, task, kept_heads: Sequence[int]):
    """The gated model with every encoder head but ``kept_heads`` pruned, as
    ``head_pruning.prune_checkpoint`` prunes a checkpoint: the closed gates say which heads go,
    the spec records the kept heads, and the weights are cut out of the gated model's."""
    for module in head_pruning.attention_modules(gated).values():
        if module.head_gates is not None:
            closed = [h for h in range(module.num_heads) if h not in kept_heads]
            with torch.no_grad():
                module.head_gates.log_alpha[closed] = CLOSED_LOG_ALPHA
    kept = head_pruning.heads_by_layer(gated, after_gates=True)
    pruned_args = head_pruning.pruned_config(args, kept)
    pruned = task.build_model(pruned_args)
    state = dict(gated.state_dict())
    pruned_modules = head_pruning.attention_modules(pruned)
    for name, old in head_pruning.attention_modules(gated).items():
        for key in [k for k in state if k.startswith(name + ".")]:
            del state[key]
        state.update(head_pruning.pruned_attention_state(old, pruned_modules[name], name))
    pruned.load_state_dict(state, strict=True, model_cfg=pruned_args)
    return pruned


def module_contender(module: nn.Module, x: Tensor, padding: Optional[Tensor]) -> Contender:
    """The module called as fairseq's encoder layer calls its self-attention."""

    def forward():
        return module(x, x, x, key_padding_mask=padding, need_weights=False)[0]

    return Contender(forward, (x, *module.parameters()), module)


def banded_row(kind: RowKind, device: torch.device) -> Row:
    q, k, v = (
        torch.randn(BANDED_SHAPE, device=device, requires_grad=True) for _ in range(3)
    )

    def ours():
        return banded_attention(q, k, v, BANDED_WINDOW, BANDED_WINDOW)

    def peer():
        return F.scaled_dot_product_attention(q, k, v)

    return Row(kind, Contender(ours, (q, k, v)), Contender(peer, (q, k, v)))


def module_inputs(device: torch.device, padding_mask: bool):
    """x (T, B, C) and the key_padding_mask fairseq's encoder passes for a batch without
    padding: None (fairseq drops a mask with no padding), or ``padding_mask`` an all-False one."""
    x = torch.randn(LENGTH, BATCH, EMBED_DIM, device=device, requires_grad=True)
    padding = torch.zeros(BATCH, LENGTH, dtype=torch.bool, device=device) if padding_mask else None
    return x, padding


def build_rows(names: Sequence[str], device: torch.device, padding_mask: bool = False) -> List[Row]:
    """The rows named, in the table's order, every module in training mode."""
    torch.manual_seed(0)
    kinds = [kind for kind in ROW_KINDS if kind.name in names]
    rows = []
    x, padding = module_inputs(device, padding_mask)
    peer = None
    with ModelBuilder() as builder:
        for kind in kinds:
            if kind.arch is None:
                rows.append(banded_row(kind, device))
                continue
            if peer is None:
                fairseq_model, _, _ = builder.build("transformer")
                peer = module_contender(
                    encoder_self_attention(fairseq_model.to(device).train()), x, padding
                )
            model, args, task = builder.build(kind.arch, kind.options)
            if kind.name == "pruned":
                model = pruned_model(model, args, task, PRUNED_KEPT_HEADS)
            module = encoder_self_attention(model.to(device).train())
            rows.append(Row(kind, module_contender(module, x, padding), peer))
    return rows


# -- measuring ---------------------------------------------------------------------------------


@dataclass
class RowResult:
    kind: RowKind
    host: Dict[str, List[float]]  # "ours" / "peer": seconds per call, one value per round
    operations: Dict[str, int]  # aten operations per call, views aside
    device: Optional[Dict[str, float]] = None  # GPU busy seconds per call (CUDA only)

    def host_median(self, side: str) -> float:
        return statistics.median(self.host[side])

    @property
    def ratio(self) -> float:
        return self.host_median("ours") / self.host_median("peer")

    @property
    def round_ratios(self) -> List[float]:
        return [a / b for a, b in zip(self.host["ours"], self.host["peer"])]

    @property
    def met(self) -> bool:
        # Judged on the ratio as the table prints it, so that a row never reads "1.30, <= 1.3, no".
        return round(self.ratio, 2) <= self.kind.target


def measure_row(row: Row, rounds: int, calls: int, device: torch.device) -> RowResult:
    sides = {"ours": row.ours.training_call(), "peer": row.peer.training_call()}
    for call in sides.values():  # first calls: lazy loading, allocator growth
        for _ in range(max(5, calls // 10)):
            call()
    operations = {side: operations_per_call(call) for side, call in sides.items()}
    host = alternating_rounds(
        {
            side: (lambda call=call: host_seconds_per_call(call, calls, device))
            for side, call in sides.items()
        },
        rounds,
    )
    busy = None
    if device.type == "cuda":
        busy = {side: device_seconds_per_call(call, calls) for side, call in sides.items()}
    return RowResult(row.kind, host, operations, busy)


def profile_table(contender: Contender, calls: int, device: torch.device, limit: int) -> str:
    """torch.profiler's operations of ``calls`` calls, the most expensive on the host first."""
    call = contender.training_call()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            call()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=limit)


# -- the report --------------------------------------------------------------------------------


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f}"


def report(results: Sequence[RowResult], settings: str, cuda: bool) -> str:
    """The markdown table: per row the two sides' time per call, their ratio and the target."""
    lines = [settings, ""]
    if cuda:
        lines += [
            "| what | peer | ours host us/call | peer host us/call | host ratio | per round "
            "| ours GPU us/call | peer GPU us/call | GPU ratio | target | met "
            "| ops/call ours | ops/call peer |",
            "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---|---:|---:|",
        ]
    else:
        lines += [
            "| what | peer | ours us/call | peer us/call | ratio | per round | target | met "
            "| ops/call ours | ops/call peer |",
            "|---|---|---:|---:|---:|---|---:|---|---:|---:|",
        ]
    for result in results:
        kind = result.kind
        rounds = f"{min(result.round_ratios):.2f}-{max(result.round_ratios):.2f}"
        cells = [
            kind.ours,
            kind.peer,
            _us(result.host_median("ours")),
            _us(result.host_median("peer")),
            f"{result.ratio:.2f}",
            rounds,
        ]
        if cuda:
            ours, peer = result.device["ours"], result.device["peer"]
            cells += [_us(ours), _us(peer), f"{ours / peer:.2f}"]
        cells += [
            f"<= {kind.target:.1f}",
            "yes" if result.met else "no",
            str(result.operations["ours"]),
            str(result.operations["peer"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# The first words of the benchmark's table (and of its --output file).
TABLE_START = "host overhead per call ("


def settings_line(device: torch.device, rounds: int, calls: int, padding_mask: bool) -> str:
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)} (host time: issuing the calls; GPU time: "
        where += "the profiler's kernel time)"
    else:
        where = f"CPU, torch threads {torch.get_num_threads()} (the process's CPU time)"
    mask = "an all-False key_padding_mask" if padding_mask else "key_padding_mask None"
    return (
        f"{TABLE_START}forward + backward, float32), {where}, torch "
        f"{torch.__version__}; median of {rounds} rounds x {calls} calls, ours and peer "
        f"alternating; modules in training mode, {mask}; ratio = ours / peer (medians)"
    )


def run(
    names: Sequence[str],
    device: torch.device,
    rounds: int,
    calls: int,
    padding_mask: bool = False,
    progress: Optional[Callable[[str], None]] = None,
) -> Tuple[List[Row], List[RowResult]]:
    """Build the rows named, then time them one after another; ``progress`` hears each ratio."""
    rows = build_rows(names, device, padding_mask)
    results = []
    for row in rows:
        results.append(measure_row(row, rounds, calls, device))
        if progress:
            progress(f"{row.kind.name}: ratio {results[-1].ratio:.2f}")
    return rows, results


def profiles(rows: Sequence[Row], calls: int, device: torch.device, limit: int) -> str:
    """``profile_table`` of both sides of every row, one after another."""
    parts = []
    for row in rows:
        for side, contender in (("ours", row.ours), ("peer", row.peer)):
            what = row.kind.ours if side == "ours" else row.kind.peer
            table = profile_table(contender, calls, device, limit)
            parts.append(f"\n{row.kind.name}, {side}: {what}, {calls} calls\n{table}")
    return "\n".join(parts)

