"""The ``cudnn-band`` route of the banded operator: cuDNN's fused attention with a diagonal band,
through the graph API of nvidia-cudnn-frontend (``pip install local_attn_fairseq[cudnn]``).

How the operator's call becomes cuDNN graphs:

* Bounds (``band_bounds``): query at key position p sees keys p - L .. p + R; cuDNN keeps a
  score (row, col) when col + left_bound > row and row + right_bound >= col, so
  left_bound = L + 1 and right_bound = R, a side that reaches past the sequence left unset
  (unbounded). Queries aligned to the last keys (Tq < Tk, incremental decoding) use the
  BOTTOM_RIGHT alignment, which shifts the band by each sentence's s_kv - s_q; cuDNN refuses
  it together with dropout and a right bound, so this route takes dropout only when Tq == Tk.
* Heads are grouped by window: the bounds are constants of a graph, one graph per (L, R).
* Padding: each sentence's real tokens are moved to the front (a gather; fairseq pads on the
  left), cuDNN's padding mask takes the real lengths (``seq_len_q`` / ``seq_len_kv``), and
  the outputs are moved back. The padding must be one contiguous run on either side of a
  sentence (as the operator's interface says): a gap inside a sentence would be closed up.
  Rows whose query is padding come back as zeros with lse = -inf (cuDNN leaves them
  undefined); every real query sees at least itself.
* Shapes are bucketed (``bucket_size``): batch and lengths rounded up so that fairseq's
  changing batches reuse a few graphs, the padding mask covering the extra rows. Graphs are
  cached, least recently used first out (``cached_graph_count``, ``clear_graph_cache``).
* Stats (B, H, S_q, 1) float32 become the log-sum-exp (B, H, Tq).
* Dropout: cuDNN's Philox generator, with a seed and an offset drawn from torch's generator
  (so ``torch.manual_seed`` reproduces a run), kept for the backward. Its mask is not the
  operator's own keep-mask.
* The backward is cuDNN's ``sdpa_backward`` (deterministic when
  ``torch.use_deterministic_algorithms(True)``); second derivatives are refused by name.

Everything reaches the library through ``_library`` (a ``Frontend``), which the tests replace
with a float64 emulation of the frontend's contract. The route's limits (CUDA, float16 and
bfloat16, head dims, compute capability) are in ``unsupported_reasons``, not in the
translation, so the translation also runs on the CPU against the emulation.
"""

import collections
import importlib
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

ROUTE = "cudnn-band"
FRONTEND_MODULE = "cudnn"
# The pinned frontend (setup.py's extra "cudnn", scripts/setup_env.sh): 1.23.0 has no required
# dependencies and serves the classic graph API from its compiled module; later versions
# require nvidia-cutlass-dsl and may route attention graphs to their own Python engines.
FRONTEND_REQUIREMENT = "nvidia-cudnn-frontend==1.23.0"
INSTALL_HINT = "pip install local_attn_fairseq[cudnn]"
MIN_BACKEND_VERSION = 91002  # cuDNN 9.10.2: bands without a right bound, fp16/bf16 fixes
MAX_HEAD_DIM = 128
MIN_CAPABILITY = (8, 0)
GRAPH_CACHE_SIZE = 128
SECOND_DERIVATIVES_REFUSED = (
    f"{ROUTE}: second derivatives (a gradient of this route's gradient) are not computed by "
    "cuDNN's attention backward; set LOCAL_ATTN_BANDED_IMPL=torch to compute them with "
    "PyTorch's operations"
)

# Tensor uids of the graphs (the execute call binds buffers to these tensors).
_Q, _K, _V, _O, _STATS, _SEQ_Q, _SEQ_KV, _SEED, _OFFSET, _DO, _DQ, _DK, _DV = range(1, 14)


class Frontend:
    """The library behind the route: the ``cudnn`` module (imported on first use), one cuDNN
    handle per device and the cache of built graphs."""

    def __init__(self, module=None, cache_size: int = GRAPH_CACHE_SIZE):
        self._module = module
        self._attempted = module is not None
        self.error: Optional[BaseException] = None
        self.graphs: "collections.OrderedDict[tuple, BuiltGraph]" = collections.OrderedDict()
        self.cache_size = cache_size
        self.build_seconds: List[float] = []  # each graph build, for the GPU checks' records
        self._handles: Dict[torch.device, object] = {}
        self._streams: Dict[torch.device, int] = {}
        self.lengths: Dict[tuple, Tuple[torch.Tensor, torch.Tensor]] = {}
        self.head_indices: Dict[tuple, torch.Tensor] = {}

    def module(self):
        """The cudnn module, or None when it cannot be imported (the reason is in ``error``)."""
        if not self._attempted:
            self._attempted = True
            try:
                self._module = importlib.import_module(FRONTEND_MODULE)
            except Exception as error:  # not installed, or no loadable libcudnn beside it
                self.error = error
        return self._module

    def handle(self, cudnn, device: torch.device):
        """This device's cuDNN handle, set to run on torch's current stream."""
        handle = self._handles.get(device)
        if handle is None:
            if device.type == "cuda":
                with torch.cuda.device(device):
                    handle = cudnn.create_handle()
            else:
                handle = cudnn.create_handle()
            self._handles[device] = handle
        if device.type == "cuda":
            stream = torch.cuda.current_stream(device).cuda_stream
            if self._streams.get(device) != stream:  # setting it costs driver queries
                cudnn.set_stream(handle=handle, stream=stream)
                self._streams[device] = stream
        return handle

    def graph(self, key: "GraphSpec", build):
        """The graph of ``key``, built by ``build()`` when the cache lacks it."""
        graph = self.graphs.get(key)
        if graph is not None:
            self.graphs.move_to_end(key)
            return graph
        start = time.perf_counter()
        graph = build()
        self.build_seconds.append(time.perf_counter() - start)
        self.graphs[key] = graph
        while len(self.graphs) > self.cache_size:
            self.graphs.popitem(last=False)
        return graph


_library = Frontend()


def cached_graph_count() -> int:
    """How many built graphs (forward and backward) the route holds."""
    return len(_library.graphs)


def clear_graph_cache() -> None:
    _library.graphs.clear()


# ---------------------------------------------------------------------------------------------
# The translation, as pure functions.


def band_bounds(
    left: int, right: int, query_length: int, key_length: int
) -> Tuple[Optional[int], Optional[int], str]:
    """cuDNN's (diagonal_band_left_bound, diagonal_band_right_bound, alignment) of a window.

    Query i sits at key position p = i + Tk - Tq and sees keys p - left .. p + right. cuDNN
    keeps col when col + left_bound > row and row + right_bound >= col, after shifting row by
    s_kv - s_q under BOTTOM_RIGHT: left_bound = left + 1, right_bound = right. A bound that no
    query can reach past (left >= Tk - 1, right >= Tq - 1) is None, cuDNN's unbounded side.
    """
    if left < 0 or right < 0:
        raise ValueError(f"{ROUTE}: windows must be >= 0, got left {left}, right {right}")
    left_bound = None if left >= key_length - 1 else left + 1
    right_bound = None if right >= query_length - 1 else right
    alignment = "TOP_LEFT" if query_length == key_length else "BOTTOM_RIGHT"
    return left_bound, right_bound, alignment


def bucket_size(n: int, smallest: int = 1) -> int:
    """n rounded up to a bucket: ``smallest`` and below, then four steps per power of two
    (at most 25% extra rows), so that changing batch shapes reuse a few graphs."""
    if n <= smallest:
        return smallest
    if n <= 4:
        return n
    step = 1 << ((n - 1).bit_length() - 3)
    return -(-n // step) * step


MIN_LENGTH_BUCKET = 16  # also keeps s_q = s_kv = 1, which the backward refuses, out


@dataclass(frozen=True)
class HeadGroup:
    """Heads sharing one window: a slice when they are consecutive, else an index."""

    left: int
    right: int
    heads: Tuple[int, ...]

    def index(self, device: torch.device):
        """A slice when the heads are consecutive, else an index tensor on ``device`` (made
        once: indexing a GPU tensor with a host list would copy and wait on every call)."""
        first, count = self.heads[0], len(self.heads)
        if self.heads == tuple(range(first, first + count)):
            return slice(first, first + count)
        key = (self.heads, device)
        index = _library.head_indices.get(key)
        if index is None:
            index = _library.head_indices[key] = torch.tensor(self.heads, device=device)
        return index

    def select(self, x: torch.Tensor, all_heads: int) -> torch.Tensor:
        if len(self.heads) == all_heads and self.heads[0] == 0:
            return x
        return x[:, self.index(x.device)]


def window_groups(left: Sequence[int], right: Sequence[int]) -> Tuple[HeadGroup, ...]:
    """The heads of each distinct (left, right) window, in order of first appearance."""
    heads: Dict[Tuple[int, int], List[int]] = {}
    for head, window in enumerate(zip(left, right)):
        heads.setdefault(window, []).append(head)
    return tuple(HeadGroup(l, r, tuple(h)) for (l, r), h in heads.items())


@dataclass
class Layout:
    """Where each sentence's real tokens go in the graphs' bucketed tensors, and back.

    ``*_gather`` (B, T): source position of each packed row (real tokens first); ``*_scatter``
    (B, T): packed row of each original position; ``real_*`` (B, T) bool; all None without a
    key padding mask. ``seq_len_*`` (Bb, 1, 1, 1) int32 when the padding mask is on.
    """

    batch: int
    query_length: int
    key_length: int
    batch_bucket: int
    query_bucket: int
    key_bucket: int
    padded: bool
    query_gather: Optional[torch.Tensor] = None
    key_gather: Optional[torch.Tensor] = None
    query_scatter: Optional[torch.Tensor] = None
    key_scatter: Optional[torch.Tensor] = None
    real_queries: Optional[torch.Tensor] = None
    real_keys: Optional[torch.Tensor] = None
    seq_len_q: Optional[torch.Tensor] = None
    seq_len_kv: Optional[torch.Tensor] = None


def _lengths_tensor(lengths: torch.Tensor, batch_bucket: int) -> torch.Tensor:
    """(Bb, 1, 1, 1) int32 for the padding mask. An empty sentence, and each bucket row past
    the batch, gets length 1 (what the kernels do with 0 is not documented); their rows are
    zeroed afterwards anyway."""
    full = torch.ones(batch_bucket, dtype=torch.int32, device=lengths.device)
    full[: lengths.shape[0]] = lengths.clamp(min=1)
    return full.view(batch_bucket, 1, 1, 1)


def make_layout(
    key_padding_mask: Optional[torch.Tensor], batch: int, query_length: int, key_length: int,
    device: torch.device,
) -> Layout:  # fmt: skip
    buckets = (
        bucket_size(batch),
        bucket_size(query_length, MIN_LENGTH_BUCKET),
        bucket_size(key_length, MIN_LENGTH_BUCKET),
    )
    shapes = (batch, query_length, key_length)
    if key_padding_mask is None:
        layout = Layout(*shapes, *buckets, padded=buckets != shapes)
        if layout.padded:
            layout.seq_len_q, layout.seq_len_kv = _full_lengths(*shapes, buckets[0], device)
        return layout
    shift = key_length - query_length
    real_keys = ~key_padding_mask
    real_queries = real_keys[:, shift:]
    key_start = real_keys.to(torch.int32).argmax(1)  # the first real key (0 when none)
    query_start = (key_start - shift).clamp(min=0)
    keys = torch.arange(key_length, device=device)
    queries = keys[:query_length]
    return Layout(
        *shapes, *buckets, padded=True,
        query_gather=(queries + query_start[:, None]).clamp(max=query_length - 1),
        key_gather=(keys + key_start[:, None]).clamp(max=key_length - 1),
        query_scatter=(queries - query_start[:, None]).clamp(min=0),
        key_scatter=(keys - key_start[:, None]).clamp(min=0),
        real_queries=real_queries,
        real_keys=real_keys,
        seq_len_q=_lengths_tensor(real_queries.sum(1), buckets[0]),
        seq_len_kv=_lengths_tensor(real_keys.sum(1), buckets[0]),
    )  # fmt: skip


def _full_lengths(batch, query_length, key_length, batch_bucket, device):
    """The lengths of a batch without padding that does not fill its bucket (cached)."""
    key = (device, batch, query_length, key_length, batch_bucket)
    lengths = _library.lengths.get(key)
    if lengths is None:
        if len(_library.lengths) >= GRAPH_CACHE_SIZE:
            _library.lengths.clear()
        queries = torch.full((batch,), query_length, dtype=torch.int32, device=device)
        lengths = (
            _lengths_tensor(queries, batch_bucket),
            _lengths_tensor(queries + (key_length - query_length), batch_bucket),
        )
        _library.lengths[key] = lengths
    return lengths


def _per_row(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A (B, T) tensor viewed to broadcast over (B, H, T, ...) ``like``."""
    return t.view(t.shape[0], 1, t.shape[1], *([1] * (like.dim() - 3)))


def _time_index(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return _per_row(index, like).expand(like.shape)


def pack(x: torch.Tensor, group: HeadGroup, gather, batch_bucket, length_bucket) -> torch.Tensor:
    """A group's heads of x (B, H, T, D) as the graph's (Bb, Hg, Sb, D) contiguous tensor: real
    tokens first, zeros in the bucket's extra rows (never read, but kept finite). x itself when
    it is that tensor already (16-byte aligned, as the kernels load it)."""
    part = group.select(x, x.shape[1])
    if gather is not None:
        part = part.gather(2, _time_index(gather, part))
    batch, heads, length, dim = part.shape
    if (
        (batch, length) == (batch_bucket, length_bucket)
        and part.is_contiguous()
        and part.data_ptr() % 16 == 0
    ):
        return part
    packed = part.new_zeros(batch_bucket, heads, length_bucket, dim)
    packed[:batch, :, :length] = part
    return packed


def unpack(
    buffers: Sequence[torch.Tensor], groups: Sequence[HeadGroup], heads: int, batch: int,
    length: int, scatter: Optional[torch.Tensor], real: Optional[torch.Tensor], fill: float,
) -> torch.Tensor:  # fmt: skip
    """The groups' (Bb, Hg, Sb, ...) results as one (B, H, T, ...) tensor in the original
    positions, ``fill`` where the position is padding."""
    if len(groups) == 1 and len(groups[0].heads) == heads:
        whole = buffers[0][:batch, :, :length]
    else:
        first = buffers[0]
        whole = first.new_empty(batch, heads, length, *first.shape[3:])
        for group, buffer in zip(groups, buffers):
            whole[:, group.index(whole.device)] = buffer[:batch, :, :length]
    if scatter is not None:
        whole = whole.gather(2, _time_index(scatter, whole))
    if real is not None:
        whole = whole.masked_fill(~_per_row(real, whole), fill)
    return whole


# ---------------------------------------------------------------------------------------------
# Graphs.


@dataclass
class BuiltGraph:
    graph: object
    tensors: Dict[int, object]  # uid -> the graph's tensor
    workspace_bytes: int

    def execute(self, cudnn_handle, buffers: Dict[int, torch.Tensor], device) -> None:
        workspace = torch.empty(max(self.workspace_bytes, 1), dtype=torch.uint8, device=device)
        pack_ = {self.tensors[uid]: buffer for uid, buffer in buffers.items()}
        self.graph.execute(pack_, workspace, handle=cudnn_handle)


_IO_TYPES = {
    torch.float16: "HALF",
    torch.bfloat16: "BFLOAT16",
    torch.float32: "FLOAT",  # the emulation's; cuDNN's attention takes HALF and BFLOAT16
    torch.float64: "DOUBLE",
}


@dataclass(frozen=True)
class GraphSpec:
    """Everything a graph is built from: the cache key."""

    backward: bool
    dtype: torch.dtype
    device: torch.device
    batch: int
    heads: int
    query_length: int
    key_length: int
    head_dim: int
    left_bound: Optional[int]
    right_bound: Optional[int]
    alignment: str
    padded: bool
    scale: float
    dropout_p: float
    deterministic: bool


def _packed_strides(dims):
    strides, step = [], 1
    for size in reversed(dims):
        strides.append(step)
        step *= size
    return strides[::-1]


def _build(cudnn, handle, spec: GraphSpec) -> BuiltGraph:
    io = getattr(cudnn.data_type, _IO_TYPES[spec.dtype])
    graph = cudnn.pygraph(
        io_data_type=io,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
        handle=handle,
    )
    q_dims = [spec.batch, spec.heads, spec.query_length, spec.head_dim]
    kv_dims = [spec.batch, spec.heads, spec.key_length, spec.head_dim]
    stats_dims = q_dims[:3] + [1]
    tensors = {}

    def declare(uid, name, dims, data_type):
        tensors[uid] = graph.tensor(name=name, dim=dims, stride=_packed_strides(dims),
                                    data_type=data_type, uid=uid)  # fmt: skip
        return tensors[uid]

    q = declare(_Q, "q", q_dims, io)
    k, v = declare(_K, "k", kv_dims, io), declare(_V, "v", kv_dims, io)
    options = dict(
        attn_scale=spec.scale,
        use_padding_mask=spec.padded,
        diagonal_alignment=getattr(cudnn.diagonal_alignment, spec.alignment),
        diagonal_band_left_bound=spec.left_bound,
        diagonal_band_right_bound=spec.right_bound,
        compute_data_type=cudnn.data_type.FLOAT,
    )
    if spec.padded:
        options["seq_len_q"] = declare(_SEQ_Q, "seq_len_q", [spec.batch, 1, 1, 1],
                                       cudnn.data_type.INT32)  # fmt: skip
        options["seq_len_kv"] = declare(_SEQ_KV, "seq_len_kv", [spec.batch, 1, 1, 1],
                                        cudnn.data_type.INT32)  # fmt: skip
    if spec.dropout_p > 0:
        seed = declare(_SEED, "seed", [1, 1, 1, 1], cudnn.data_type.INT64)
        offset = declare(_OFFSET, "offset", [1, 1, 1, 1], cudnn.data_type.INT64)
        options["dropout"] = (spec.dropout_p, seed, offset)
    if spec.backward:
        o = declare(_O, "o", q_dims, io)
        grad_out = declare(_DO, "dO", q_dims, io)
        stats = declare(_STATS, "stats", stats_dims, cudnn.data_type.FLOAT)
        outputs = graph.sdpa_backward(
            q=q, k=k, v=v, o=o, dO=grad_out, stats=stats, name="band_backward",
            use_deterministic_algorithm=spec.deterministic, **options,
        )  # fmt: skip
        declared = zip((_DQ, _DK, _DV), outputs, (q_dims, kv_dims, kv_dims), (io, io, io))
    else:
        outputs = graph.sdpa(q=q, k=k, v=v, generate_stats=True, name="band", **options)
        declared = zip((_O, _STATS), outputs, (q_dims, stats_dims), (io, cudnn.data_type.FLOAT))
    for uid, output, dims, data_type in declared:
        output.set_uid(uid).set_output(True).set_dim(dims).set_stride(_packed_strides(dims))
        output.set_data_type(data_type)
        tensors[uid] = output
    try:
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
    except Exception as error:  # the frontend's refusals come as several exception types
        first_line = (str(error).strip() or type(error).__name__).splitlines()[0]
        raise RuntimeError(
            f"{ROUTE}: cuDNN cannot build the {'backward' if spec.backward else 'forward'} graph "
            f"for {spec}: {first_line}"
        ) from error
    return BuiltGraph(graph, tensors, graph.get_workspace_size())


def _graph_spec(backward, x, group, layout, scale, dropout_p) -> GraphSpec:
    left_bound, right_bound, alignment = band_bounds(
        group.left, group.right, layout.query_length, layout.key_length
    )
    return GraphSpec(
        backward=backward, dtype=x.dtype, device=x.device, batch=layout.batch_bucket,
        heads=len(group.heads), query_length=layout.query_bucket, key_length=layout.key_bucket,
        head_dim=x.shape[-1], left_bound=left_bound, right_bound=right_bound,
        alignment=alignment, padded=layout.padded, scale=scale, dropout_p=dropout_p,
        deterministic=backward and torch.are_deterministic_algorithms_enabled(),
    )  # fmt: skip


def _run(spec: GraphSpec, buffers: Dict[int, torch.Tensor]) -> None:
    cudnn = _library.module()
    if cudnn is None:
        raise RuntimeError(
            f"{ROUTE}: nvidia-cudnn-frontend cannot be imported ({_library.error}); {INSTALL_HINT}"
        )
    handle = _library.handle(cudnn, spec.device)
    graph = _library.graph(spec, lambda: _build(cudnn, handle, spec))
    graph.execute(handle, buffers, spec.device)


def _common_buffers(layout: Layout, seeds: Optional[torch.Tensor], index: int):
    buffers = {}
    if layout.padded:
        buffers[_SEQ_Q], buffers[_SEQ_KV] = layout.seq_len_q, layout.seq_len_kv
    if seeds is not None:
        buffers[_SEED], buffers[_OFFSET] = seeds[index, 0:1], seeds[index, 1:2]
    return buffers


def _packed_inputs(q, k, v, group, layout):
    query_side = (layout.query_gather, layout.batch_bucket, layout.query_bucket)
    key_side = (layout.key_gather, layout.batch_bucket, layout.key_bucket)
    return pack(q, group, *query_side), pack(k, group, *key_side), pack(v, group, *key_side)


# ---------------------------------------------------------------------------------------------
# The autograd function.


class _SecondDerivativesRefused(torch.autograd.Function):
    """Gradients that depend on their sources only through a refusal: a gradient of them is
    one error naming the route."""

    @staticmethod
    def forward(ctx, count, *gradients_and_sources):
        return tuple(g.clone() for g in gradients_and_sources[:count])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(SECOND_DERIVATIVES_REFUSED)


class _CudnnBandAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, left, right, key_padding_mask, scale, dropout_p):
        batch, heads, query_length, dim = q.shape
        layout = make_layout(key_padding_mask, batch, query_length, k.shape[2], q.device)
        groups = window_groups(left, right)
        seeds = None
        if dropout_p > 0:  # one Philox seed and offset per graph, from torch's generator
            seeds = torch.randint(0, 2**62, (len(groups), 2, 1, 1, 1), dtype=torch.int64,
                                  device=q.device)  # fmt: skip
        outs, stats = [], []
        for index, group in enumerate(groups):
            spec = _graph_spec(False, q, group, layout, scale, dropout_p)
            q_b, k_b, v_b = _packed_inputs(q, k, v, group, layout)
            out_b = q_b.new_empty(q_b.shape)
            stats_b = torch.empty(*q_b.shape[:3], 1, dtype=torch.float32, device=q.device)
            buffers = {_Q: q_b, _K: k_b, _V: v_b, _O: out_b, _STATS: stats_b}
            _run(spec, {**buffers, **_common_buffers(layout, seeds, index)})
            outs.append(out_b)
            stats.append(stats_b)
        unpack_rows = (heads, batch, query_length, layout.query_scatter, layout.real_queries)
        out = unpack(outs, groups, *unpack_rows, 0.0)
        lse = unpack([s[..., 0] for s in stats], groups, *unpack_rows, float("-inf"))
        ctx.mark_non_differentiable(lse)
        ctx.layout, ctx.groups, ctx.band = layout, groups, (scale, dropout_p)
        ctx.save_for_backward(q, k, v, seeds, *outs, *stats)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, seeds, *saved = ctx.saved_tensors
        layout, groups = ctx.layout, ctx.groups
        scale, dropout_p = ctx.band
        outs, stats = saved[: len(groups)], saved[len(groups) :]
        with torch.no_grad():
            if layout.real_queries is not None:  # padded queries give nothing back
                grad_out = grad_out.masked_fill(~_per_row(layout.real_queries, grad_out), 0.0)
            grad_out = grad_out.to(q.dtype)
            grads_q, grads_k, grads_v = [], [], []
            for index, group in enumerate(groups):
                spec = _graph_spec(True, q, group, layout, scale, dropout_p)
                q_b, k_b, v_b = _packed_inputs(q, k, v, group, layout)
                grad_out_b = pack(grad_out, group, layout.query_gather, layout.batch_bucket,
                                  layout.query_bucket)  # fmt: skip
                dq_b, dk_b, dv_b = (t.new_empty(t.shape) for t in (q_b, k_b, v_b))
                buffers = {_Q: q_b, _K: k_b, _V: v_b, _O: outs[index], _DO: grad_out_b,
                           _STATS: stats[index], _DQ: dq_b, _DK: dk_b, _DV: dv_b}  # fmt: skip
                _run(spec, {**buffers, **_common_buffers(layout, seeds, index)})
                grads_q.append(dq_b)
                grads_k.append(dk_b)
                grads_v.append(dv_b)
            heads, batch = q.shape[1], q.shape[0]
            query_rows = (layout.query_length, layout.query_scatter, layout.real_queries, 0.0)
            key_rows = (layout.key_length, layout.key_scatter, layout.real_keys, 0.0)
            dq = unpack(grads_q, groups, heads, batch, *query_rows)
            dk = unpack(grads_k, groups, heads, batch, *key_rows)
            dv = unpack(grads_v, groups, heads, batch, *key_rows)
        if torch.is_grad_enabled():  # create_graph: first derivatives, second ones refused
            sources = [t for t in (q, k, v) if t.requires_grad]
            dq, dk, dv = _SecondDerivativesRefused.apply(3, dq, dk, dv, *sources)
        return dq, dk, dv, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# The route's interface (shared by the library routes of ops/).


def _window_values(window: Sequence[int], heads: int, name: str) -> Tuple[int, ...]:
    values = tuple(int(w) for w in window)
    if len(values) != heads:
        raise ValueError(f"{ROUTE}: {name} gives {len(values)} windows for {heads} heads")
    return values


def _check_call(q, k, v, left, right, key_padding_mask, dropout_p):
    batch, heads, query_length, dim = q.shape
    key_length = k.shape[2]
    if k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != dim:
        raise ValueError(
            f"{ROUTE}: q (B, H, Tq, D) and k, v (B, H, Tk, D) do not match: "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if query_length > key_length:
        raise ValueError(f"{ROUTE}: more queries ({query_length}) than keys ({key_length})")
    if min(left + right) < 0:
        raise ValueError(f"{ROUTE}: windows must be >= 0, got left {left}, right {right}")
    if dropout_p > 0 and query_length != key_length:
        raise ValueError(
            f"{ROUTE}: dropout with fewer queries than keys (a bottom-right aligned band) is "
            "refused by cuDNN"
        )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{ROUTE}: dropout_p must be in [0, 1), got {dropout_p}")
    if key_padding_mask is not None and (
        tuple(key_padding_mask.shape) != (batch, key_length) or key_padding_mask.dtype != torch.bool
    ):
        raise ValueError(
            f"{ROUTE}: key_padding_mask must be bool (batch, Tk) = {(batch, key_length)}, got "
            f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
        )


def cudnn_band_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    left: Sequence[int],
    right: Sequence[int],
    key_padding_mask: Optional[torch.Tensor],
    scale: float,
    dropout_p: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """out (B, H, Tq, D) in q's dtype and lse (B, H, Tq) float32 (natural log of the sum of
    exp(scale * q.k) over the allowed keys; -inf for a row with no allowed key, whose out row
    is zeros). q (B, H, Tq, D); k, v (B, H, Tk, D) with Tq <= Tk; query i sits at key
    position i + Tk - Tq. left[h], right[h] >= 0 per head: query at key position p sees keys
    p - left[h] .. p + right[h] that exist and are not padding (key_padding_mask (B, Tk)
    bool, True = padding, one contiguous run on either side of a sentence). Rows whose query
    is padding give zeros and lse = -inf. Differentiable in q, k and v (first derivatives;
    second derivatives refused with a RuntimeError naming the route)."""
    heads = q.shape[1]
    left, right = _window_values(left, heads, "left"), _window_values(right, heads, "right")
    dropout_p = float(dropout_p)
    _check_call(q, k, v, left, right, key_padding_mask, dropout_p)
    return _CudnnBandAttention.apply(q, k, v, left, right, key_padding_mask, float(scale),
                                     dropout_p)  # fmt: skip


def device_reasons(device: torch.device) -> List[str]:
    if device.type != "cuda":
        return [f"it runs on CUDA devices only, not {device.type}"]
    if torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
        return ["it needs a GPU of compute capability 8.0 or newer"]
    return []


def unsupported_reasons(q, k, v, left, right, key_padding_mask, dropout_p) -> List[str]:
    """What this route lacks for this call, in words (empty: it can take it)."""
    reasons = []
    cudnn = _library.module()
    if cudnn is None:
        reasons.append(
            f"nvidia-cudnn-frontend is not importable ({_library.error}); {INSTALL_HINT} "
            "on a machine with a CUDA GPU"
        )
    elif hasattr(cudnn, "backend_version") and cudnn.backend_version() < MIN_BACKEND_VERSION:
        reasons.append(f"it needs cuDNN 9.10.2 or newer, found {cudnn.backend_version()}")
    reasons += device_reasons(q.device)
    if q.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"it takes float16 and bfloat16, not {str(q.dtype).replace('torch.', '')}")
    dim = q.shape[-1]
    if dim % 8 or dim > MAX_HEAD_DIM:
        reasons.append(f"it takes head dims that are multiples of 8 up to {MAX_HEAD_DIM}, "
                       f"not {dim}")  # fmt: skip
    if min(list(left) + list(right)) < 0:
        reasons.append("it takes windows >= 0 only (a band that includes the query)")
    query_length, key_length = q.shape[2], k.shape[2]
    if query_length > key_length:
        reasons.append(f"it takes no more queries than keys, not {query_length} > {key_length}")
    elif query_length != key_length and dropout_p > 0:
        reasons.append(
            "cuDNN refuses dropout with fewer queries than keys (a bottom-right aligned band)"
        )
    if dropout_p >= 1:
        reasons.append("cuDNN refuses dropout_p = 1")
    return reasons
