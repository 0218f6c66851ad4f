"""A float64 stand-in for the part of the ``cudnn`` module (nvidia-cudnn-frontend) that
graphs of fused attention use, for running the cudnn-band adapter's argument translation on
the CPU.

Written from the library's contract, nvidia-cudnn-frontend 1.23.0 (cuDNN 9.19 as the backend):

* ``python/pygraph/sdpa.cpp``: the arguments of ``pygraph.sdpa`` / ``sdpa_backward`` and
  their types (``attn_scale`` a float; ``diagonal_band_left_bound`` / ``right_bound`` ints or
  None, None meaning unbounded; ``dropout`` a tuple (probability as a float, seed tensor,
  offset tensor); ``generate_stats`` a bool), returning [O, Stats] and [dQ, dK, dV];
* ``include/cudnn_frontend/utils/attn_score_modifiers.h``: ``padding_mask`` keeps score
  (row, col) when row < seq_len_q[b] and col < seq_len_kv[b]; ``sliding_window_mask`` keeps
  it when row + shift + right_bound >= col and col + left_bound - shift > row, where
  shift = s_kv - s_q for BOTTOM_RIGHT (per batch from seq_len_q / seq_len_kv when given, else
  from the tensors' dims) and 0 for TOP_LEFT;
* ``include/cudnn_frontend/node/scaled_dot_product_flash_attention.h`` and
  ``node/sdpa_support_surface.h``: the refusals modelled here (a right bound < 0; a left bound
  <= 0 in the backward; a right bound with BOTTOM_RIGHT together with dropout; a left bound
  without the padding mask when s_q > s_kv; head dims not multiples of 8; s_q = s_kv = 1 in
  the backward; dropout probability 1; Stats other than FLOAT; seq_len tensors without the
  padding mask and the reverse), raised where the frontend raises them, at ``validate``;
* Stats: (B, H, S_q, 1), float32, the natural log of the sum of exp over the kept scaled
  scores (max + log of the sum); the backward recomputes the probabilities from the Stats and
  O it is given, as the flash-attention backward does.

The second matrix product of the forward reads only the rows below seq_len_q and the keys
below seq_len_kv (its m and k are overridden by them), so rows past the lengths are never read
here either. What the kernels write in those rows, and in a row whose every score is masked,
is not documented: the emulator writes NaN there, so a caller that reads them is caught.

Departures from the library: it computes in float64 on any device and also takes float32 and
float64 tensors (data type FLOAT / DOUBLE), where cuDNN takes float16 and bfloat16 on sm80 or
newer GPUs. Philox dropout is emulated: the keep-mask comes from a torch generator seeded by
the (seed, offset) tensors' values, so the same seed and offset give the same mask in the
forward and the backward (the real mask differs; its expectation is the same). Tensors are
read as the library reads device memory, through the dims and strides declared in the graph
(``as_strided`` on the buffer bound to them).
"""

import enum
import itertools
import math
from typing import Dict, List, Optional

import torch

__version__ = "1.23.0"
BACKEND_VERSION = 91900
WORKSPACE_BYTES = 256  # the emulated plans ask for a workspace, as the real ones do


class cudnnGraphNotSupportedError(Exception):
    pass


class data_type(enum.Enum):
    NOT_SET = 0
    HALF = 1
    BFLOAT16 = 2
    FLOAT = 3
    DOUBLE = 4
    INT32 = 5
    INT64 = 6


class diagonal_alignment(enum.Enum):
    TOP_LEFT = 0
    BOTTOM_RIGHT = 1


class heur_mode(enum.Enum):
    A = 0
    B = 1
    FALLBACK = 2


_NOT_SET = data_type.NOT_SET  # the name data_type is also the graph methods' argument

TORCH_DTYPES = {
    data_type.HALF: torch.float16,
    data_type.BFLOAT16: torch.bfloat16,
    data_type.FLOAT: torch.float32,
    data_type.DOUBLE: torch.float64,
    data_type.INT32: torch.int32,
    data_type.INT64: torch.int64,
}

_handles = itertools.count(1)


def backend_version() -> int:
    return BACKEND_VERSION


def create_handle() -> int:
    return next(_handles)


def set_stream(handle, stream) -> None:
    if not isinstance(handle, int):
        raise TypeError(f"set_stream: handle must be an int, got {type(handle).__name__}")


def _packed_strides(dims: List[int]) -> List[int]:
    strides, step = [], 1
    for size in reversed(dims):
        strides.append(step)
        step *= size
    return strides[::-1]


class tensor:
    """A tensor of a graph: declared dims, strides and data type, and a uid."""

    def __init__(self, name, dim, stride, data_type_, is_virtual, uid):
        self.name = name
        self.dim = list(dim) if dim is not None else None
        self.stride = list(stride) if stride is not None else None
        self.data_type = data_type_
        self.is_virtual = is_virtual
        self.uid = uid
        self.is_output = False

    def set_uid(self, uid):
        self.uid = int(uid)
        return self

    def get_uid(self):
        return self.uid

    def set_output(self, value):
        self.is_output = bool(value)
        self.is_virtual = not value
        return self

    def set_dim(self, dim):
        self.dim = list(dim)
        return self

    def get_dim(self):
        return list(self.dim)

    def set_stride(self, stride):
        self.stride = list(stride)
        return self

    def get_stride(self):
        return list(self.stride)

    def set_data_type(self, value):
        self.data_type = value
        return self

    def get_data_type(self):
        return self.data_type


class _Attention:
    """The attributes of one sdpa or sdpa_backward node."""

    def __init__(self, backward, q, k, v, o, d_o, stats, options):
        self.backward = backward
        self.q, self.k, self.v, self.o, self.d_o, self.stats = q, k, v, o, d_o, stats
        self.scale = options["attn_scale"]
        self.padding = options["use_padding_mask"]
        self.seq_len_q, self.seq_len_kv = options["seq_len_q"], options["seq_len_kv"]
        self.alignment = options["diagonal_alignment"]
        self.left = options["diagonal_band_left_bound"]
        self.right = options["diagonal_band_right_bound"]
        self.dropout = options["dropout"]
        self.outputs: Dict[str, tensor] = {}


def _check_int_bound(value, name):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise RuntimeError(f"{name} must be an int (or None)")


def _check_options(options):
    scale = options["attn_scale"]
    if scale is not None and not isinstance(scale, float):
        raise RuntimeError("attn_scale must be a cudnn_tensor or float.")
    _check_int_bound(options["diagonal_band_left_bound"], "diagonal_band_left_bound")
    _check_int_bound(options["diagonal_band_right_bound"], "diagonal_band_right_bound")
    if not isinstance(options["diagonal_alignment"], diagonal_alignment):
        raise TypeError("diagonal_alignment must be a cudnn.diagonal_alignment")
    dropout = options["dropout"]
    if dropout is not None:
        if not isinstance(dropout, tuple) or len(dropout) != 3:
            raise RuntimeError(
                "dropout must be a tuple of (float probability, a seed tensor, and an offset "
                "tensor)"
            )
        if not isinstance(dropout[0], float):
            raise RuntimeError("dropout mask must be a cudnn_tensor.")
        if not (isinstance(dropout[1], tensor) and isinstance(dropout[2], tensor)):
            raise RuntimeError("dropout seed and offset must be cudnn_tensors.")


_FORWARD_OPTIONS = dict(
    attn_scale=None, use_padding_mask=False, seq_len_q=None, seq_len_kv=None,
    diagonal_alignment=diagonal_alignment.TOP_LEFT, diagonal_band_left_bound=None,
    diagonal_band_right_bound=None, dropout=None, generate_stats=None,
    compute_data_type=data_type.NOT_SET, name="",
)  # fmt: skip
_BACKWARD_OPTIONS = {
    **{k: v for k, v in _FORWARD_OPTIONS.items() if k != "generate_stats"},
    "use_deterministic_algorithm": False,
}


def _take_options(defaults, given, operation):
    unknown = set(given) - set(defaults)
    if unknown:
        raise TypeError(f"{operation}() got unexpected keyword arguments {sorted(unknown)}")
    return {**defaults, **given}


class pygraph:
    """A graph of one sdpa or sdpa_backward node, built and executed in float64."""

    def __init__(self, name="", io_data_type=data_type.NOT_SET,
                 intermediate_data_type=data_type.NOT_SET, compute_data_type=data_type.NOT_SET,
                 handle=None, **kwargs):  # fmt: skip
        self.io_data_type = io_data_type
        self.intermediate_data_type = intermediate_data_type
        self.handle = handle
        self.tensors: List[tensor] = []
        self.node: Optional[_Attention] = None
        self.stage = "building"
        self._uids = itertools.count(1_000_000)

    # -- building ----------------------------------------------------------------------------

    def tensor(self, name="", dim=None, stride=None, data_type=data_type.NOT_SET,
               is_virtual=False, uid=-1, **kwargs):  # fmt: skip
        declared = self.io_data_type if data_type == _NOT_SET else data_type
        made = tensor(name, dim, stride, declared, is_virtual, int(uid))
        if stride is None and dim is not None:
            made.stride = _packed_strides(made.dim)
        self.tensors.append(made)
        return made

    def _output(self, name, dim, declared):
        made = tensor(name, dim, _packed_strides(dim), declared, True, next(self._uids))
        self.tensors.append(made)
        return made

    def _add_node(self, node):
        if self.node is not None:
            raise RuntimeError("the emulator models graphs of one attention node")
        self.node = node

    def sdpa(self, q, k, v, **options):
        options = _take_options(_FORWARD_OPTIONS, options, "sdpa")
        _check_options(options)
        if not isinstance(options["generate_stats"], bool):
            raise RuntimeError("generate_stats must be provided.")
        node = _Attention(False, q, k, v, None, None, None, options)
        o_dim = q.dim[:-1] + v.dim[-1:]
        node.outputs["O"] = self._output(f"{options['name']}::O", o_dim, self.io_data_type)
        stats = None
        if options["generate_stats"]:
            stats = self._output(f"{options['name']}::Stats", q.dim[:-1] + [1], data_type.FLOAT)
            node.outputs["Stats"] = stats
        self._add_node(node)
        return [node.outputs["O"], stats]

    def sdpa_backward(self, q, k, v, o, dO, stats, **options):
        options = _take_options(_BACKWARD_OPTIONS, options, "sdpa_backward")
        _check_options(options)
        node = _Attention(True, q, k, v, o, dO, stats, options)
        for name, like in (("dQ", q), ("dK", k), ("dV", v)):
            name_in_graph = f"{options['name']}::{name}"
            node.outputs[name] = self._output(name_in_graph, like.dim, like.data_type)
        self._add_node(node)
        return [node.outputs["dQ"], node.outputs["dK"], node.outputs["dV"]]

    # -- the build steps ---------------------------------------------------------------------

    def _advance(self, expected, following):
        if self.stage != expected:
            raise RuntimeError(f"graph step out of order: at {self.stage!r}, expected {expected!r}")
        self.stage = following

    def validate(self):
        if self.node is None:
            raise ValueError("the graph has no operation")
        _validate(self.node)
        self._advance("building", "validated")

    def build_operation_graph(self):
        self._advance("validated", "operation graph")

    def create_execution_plans(self, modes):
        if not modes or not all(isinstance(m, heur_mode) for m in modes):
            raise TypeError("create_execution_plans takes a list of cudnn.heur_mode")
        self._advance("operation graph", "plans")

    def check_support(self):
        self._advance("plans", "supported")

    def build_plans(self, *args):
        self._advance("supported", "built")

    def build(self, modes):
        self.validate()
        self.build_operation_graph()
        self.create_execution_plans(modes)
        self.check_support()
        self.build_plans()

    def get_workspace_size(self):
        if self.stage != "built":
            raise RuntimeError("get_workspace_size before build_plans")
        return WORKSPACE_BYTES

    # -- execution ---------------------------------------------------------------------------

    def execute(self, variant_pack, workspace, handle=None):
        if self.stage != "built":
            raise RuntimeError("execute before build_plans")
        if not isinstance(workspace, torch.Tensor) or (
            workspace.numel() * workspace.element_size() < WORKSPACE_BYTES
        ):
            raise ValueError("execute needs a workspace of get_workspace_size() bytes")
        buffers = {(key if isinstance(key, int) else key.get_uid()): value
                   for key, value in variant_pack.items()}  # fmt: skip
        node = self.node
        run = _run_backward if node.backward else _run_forward
        run(node, lambda t: _bound(t, buffers))


def _dims_of(node):
    batch, heads_q, s_q, d_qk = node.q.dim
    _, heads_k, s_kv, _ = node.k.dim
    return batch, heads_q, heads_k, s_q, s_kv, d_qk, node.v.dim[-1]


def _validate(node):
    batch, heads_q, heads_k, s_q, s_kv, d_qk, d_v = _dims_of(node)
    left, right = node.left, node.right
    dropout = node.dropout is not None
    has_lengths = node.seq_len_q is not None or node.seq_len_kv is not None
    if node.padding and (node.seq_len_q is None or node.seq_len_kv is None):
        raise ValueError("Padding mask requires seq_len_q and seq_len_kv to be set.")
    if not node.padding and has_lengths:
        raise ValueError(
            "seq_len_q and seq_len_kv needs to be set only if padding mask is enabled."
        )
    for lengths in (node.seq_len_q, node.seq_len_kv) if node.padding else ():
        if lengths.dim != [batch, 1, 1, 1] or lengths.data_type != data_type.INT32:
            raise ValueError("seq_len tensors must be INT32 of dims (batch, 1, 1, 1)")
    if heads_q != heads_k:
        raise NotImplementedError("the emulator models as many key heads as query heads")
    if d_qk % 8 or d_v % 8:
        raise cudnnGraphNotSupportedError("hidden_dim should be multiple of 8")
    if dropout and node.dropout[0] == 1.0:
        raise ValueError(
            "Dropout probability cannot be 1 as corresponding scale wont be well formed."
        )
    bottom_right = node.alignment == diagonal_alignment.BOTTOM_RIGHT
    if right is not None and bottom_right and dropout:
        raise cudnnGraphNotSupportedError(
            "Bottom right causal mask is only supported with is_bias=False, is_alibi=False, "
            "is_dropout=False."
        )
    if right is not None and bottom_right and not node.padding and s_q > s_kv:
        raise cudnnGraphNotSupportedError(
            "Bottom right causal mask does not support max_s_q > max_s_kv."
        )
    if left is not None and not node.padding and s_q > s_kv:
        raise cudnnGraphNotSupportedError(
            "Sliding window attention is only supported with max_s_q <= max_s_kv."
        )
    if right is not None and right < 0:
        raise RuntimeError("Right bound needs to be larger than or equal to zero")
    if node.backward:
        if left is not None and left <= 0:
            raise RuntimeError("Left bound (Sliding window length) should be greater than zero.")
        if s_q == 1 and s_kv == 1:
            raise cudnnGraphNotSupportedError("s_q = s_kv = 1 is not supported.")
        if node.stats.data_type != data_type.FLOAT:
            raise cudnnGraphNotSupportedError("The Stats input of sdpa_backward must be FLOAT.")
    elif "Stats" in node.outputs and node.outputs["Stats"].data_type not in (
        data_type.FLOAT, data_type.NOT_SET,
    ):  # fmt: skip
        raise cudnnGraphNotSupportedError("The Stats output of sdpa must be an FP32 tensor.")


def _bound(graph_tensor: tensor, buffers) -> torch.Tensor:
    """The buffer bound to a graph tensor, read through its declared dims and strides."""
    uid = graph_tensor.uid
    if uid not in buffers:
        raise ValueError(f"variant pack misses tensor {graph_tensor.name!r} (uid {uid})")
    buffer = buffers[uid]
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"tensor {graph_tensor.name!r}: the emulator binds torch tensors only")
    expected = TORCH_DTYPES.get(graph_tensor.data_type)
    if buffer.dtype != expected:
        raise ValueError(
            f"tensor {graph_tensor.name!r} is declared {graph_tensor.data_type.name} "
            f"but bound to {buffer.dtype}"
        )
    return buffer.as_strided(graph_tensor.dim, graph_tensor.stride)


def _lengths(node, buffer_of, batch, s_q, s_kv):
    if not node.padding:
        full = torch.ones(batch, dtype=torch.long)
        return full * s_q, full * s_kv
    return (buffer_of(node.seq_len_q).reshape(batch).long().cpu(),
            buffer_of(node.seq_len_kv).reshape(batch).long().cpu())  # fmt: skip


def kept_scores(batch, s_q, s_kv, alignment, left, right, len_q, len_kv, padding):
    """(B, 1, s_q, s_kv) bool: the scores the masks of the graph keep."""
    row = torch.arange(s_q)[None, :, None]
    col = torch.arange(s_kv)[None, None, :]
    if alignment == diagonal_alignment.BOTTOM_RIGHT:
        shift = (len_kv - len_q)[:, None, None]
    else:
        shift = torch.zeros(batch, 1, 1, dtype=torch.long)
    kept = torch.ones(batch, s_q, s_kv, dtype=torch.bool)
    if right is not None:
        kept &= row + shift + right >= col
    if left is not None:
        kept &= col + left - shift > row
    if padding:
        kept &= (row < len_q[:, None, None]) & (col < len_kv[:, None, None])
    return kept[:, None]


def dropout_factor(node, buffer_of, shape):
    """The emulated Philox keep-mask divided by 1 - p, or None without dropout."""
    if node.dropout is None:
        return None
    probability, seed, offset = node.dropout
    seed_value = int(buffer_of(seed).reshape(-1)[0])
    offset_value = int(buffer_of(offset).reshape(-1)[0])
    generator = torch.Generator().manual_seed(hash((seed_value, offset_value)) & (2**63 - 1))
    keep = torch.rand(shape, generator=generator, dtype=torch.float64) >= probability
    return keep.double() / (1.0 - probability)


def _read_rows(node, buffer_of, batch, s_q, s_kv):
    """float64 Q, K and V with the rows past the lengths never read, the kept mask, the
    row masks, the reader and the scale."""
    len_q, len_kv = _lengths(node, buffer_of, batch, s_q, s_kv)
    rows_q = (torch.arange(s_q)[None, :] < len_q[:, None])[:, None, :, None]
    rows_kv = (torch.arange(s_kv)[None, :] < len_kv[:, None])[:, None, :, None]

    def read(graph_tensor, rows):
        x = buffer_of(graph_tensor).double().cpu()
        return torch.where(rows, x, torch.zeros((), dtype=torch.float64))

    q = read(node.q, rows_q)
    k, v = read(node.k, rows_kv), read(node.v, rows_kv)
    kept = kept_scores(batch, s_q, s_kv, node.alignment, node.left, node.right, len_q, len_kv,
                       node.padding)  # fmt: skip
    scale = 1.0 if node.scale is None else node.scale
    return q, k, v, kept, rows_q, rows_kv, read, scale


def _write(buffer_of, graph_tensor, value):
    target = buffer_of(graph_tensor)
    target.copy_(value.to(device=target.device, dtype=target.dtype))


def _run_forward(node, buffer_of):
    batch, _, _, s_q, s_kv, _, _ = _dims_of(node)
    q, k, v, kept, rows_q, _, _, scale = _read_rows(node, buffer_of, batch, s_q, s_kv)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~kept, -math.inf)
    row_max = scores.amax(-1, keepdim=True)
    has_key = kept.any(-1, keepdim=True)
    safe_max = torch.where(has_key, row_max, torch.zeros_like(row_max))
    lse = safe_max + torch.log(torch.exp(scores - safe_max).sum(-1, keepdim=True))
    probs = torch.where(kept, torch.exp(scores - lse), torch.zeros_like(scores))
    factor = dropout_factor(node, buffer_of, probs.shape)
    out = (probs if factor is None else probs * factor) @ v
    defined = rows_q & has_key  # rows the kernels are documented to compute
    _write(buffer_of, node.outputs["O"], torch.where(defined, out, math.nan))
    if "Stats" in node.outputs:
        _write(buffer_of, node.outputs["Stats"], torch.where(defined, lse, math.nan))


def _run_backward(node, buffer_of):
    batch, _, _, s_q, s_kv, _, _ = _dims_of(node)
    q, k, v, kept, rows_q, rows_kv, read, scale = _read_rows(node, buffer_of, batch, s_q, s_kv)
    out, grad_out = read(node.o, rows_q), read(node.d_o, rows_q)
    stats = read(node.stats, rows_q)
    scores = q @ k.transpose(-1, -2) * scale
    probs = torch.where(kept, torch.exp(scores - stats), torch.zeros_like(scores))
    factor = dropout_factor(node, buffer_of, probs.shape)
    applied = probs if factor is None else probs * factor
    grad_v = applied.transpose(-1, -2) @ grad_out
    grad_probs = grad_out @ v.transpose(-1, -2)
    if factor is not None:
        grad_probs = grad_probs * factor
    delta = (grad_out * out).sum(-1, keepdim=True)
    grad_scores = probs * (grad_probs - delta) * scale
    grad_q = grad_scores @ k
    grad_k = grad_scores.transpose(-1, -2) @ q
    _write(buffer_of, node.outputs["dQ"], torch.where(rows_q, grad_q, math.nan))
    _write(buffer_of, node.outputs["dK"], torch.where(rows_kv, grad_k, math.nan))
    _write(buffer_of, node.outputs["dV"], torch.where(rows_kv, grad_v, math.nan))
