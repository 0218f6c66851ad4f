"""What each route of the banded operator supports: one table that dispatch, the forced routes
(``LOCAL_ATTN_BANDED_IMPL``), the attention module and the docs read.

Each route declares its devices, dtypes, head dims, minimum GPU capability and features
(``FEATURES``); ``declared_reasons`` turns a call that asks for more into a list of reasons in
words, as xformers' ``not_supported_reasons`` does, and an empty list means the declarations
allow it. Whether a route is built or importable here is answered by ``ops/banded_attention.py``
(it owns the compiled extension); the two library routes add what their adapters
(``ops/flash_window.py``, ``ops/cudnn_band.py``) say of a call, imported only when asked.
"""

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from typing import FrozenSet, Iterable, List, Optional, Tuple

import torch

ALL_FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
HALF_DTYPES = (torch.float16, torch.bfloat16)

# What a route may support beyond devices, dtypes and head dims. A call names the ones it needs.
FEATURES = {
    "per_head_windows": "per-head windows",
    "query_excluding_bounds": "windows that exclude the query (left < 0 or right < 0)",
    "unequal_lengths": "fewer queries than keys (queries aligned to the last keys)",
    "padding": "key padding",
    "computed_padded_queries": "outputs of padded query rows computed as real rows",
    "dropout": "attention dropout",
    "operator_dropout_mask": "the operator's own dropout keep-mask (draw_dropout_keep)",
    "log_sum_exp": "the row log-sum-exp as an output",
    "deterministic_backward": "a deterministic backward",
    "second_derivatives": "second derivatives",
}


@dataclass(frozen=True)
class HeadDims:
    """The head dims a route takes: a list, or multiples of ``multiple_of`` up to ``maximum``
    (None: no bound), with a tighter bound on CUDA devices where ``cuda_max`` is given."""

    listed: Optional[Tuple[int, ...]] = None
    multiple_of: int = 1
    maximum: Optional[int] = None
    cuda_max: Optional[int] = None

    def allows(self, head_dim: int, device_type: str) -> bool:
        if self.listed is not None:
            return head_dim in self.listed
        if head_dim % self.multiple_of or (self.maximum is not None and head_dim > self.maximum):
            return False
        return device_type != "cuda" or self.cuda_max is None or head_dim <= self.cuda_max

    def describe(self) -> str:
        if self.listed is not None:
            return ", ".join(map(str, self.listed))
        if self.multiple_of > 1:
            return f"multiples of {self.multiple_of} up to {self.maximum}"
        return "any" if self.cuda_max is None else f"any (CUDA: up to {self.cuda_max})"


@dataclass(frozen=True)
class RouteSupport:
    """One route's declaration. ``features`` are the names of ``FEATURES`` it supports;
    ``notes`` say how, for the docs' table."""

    name: str
    what: str
    devices: Optional[Tuple[str, ...]]  # None: every device torch runs on
    dtypes: Tuple[torch.dtype, ...]
    head_dims: HeadDims
    features: FrozenSet[str]
    min_capability: Optional[Tuple[int, int]] = None
    adapter: Optional[Tuple[str, str]] = None  # (module of ops/, its attention function)
    notes: Tuple[Tuple[str, str], ...] = ()

    def supports(self, feature: str) -> bool:
        if feature not in FEATURES:
            raise ValueError(
                f"route table: unknown feature {feature!r}; the features are {', '.join(FEATURES)}"
            )
        return feature in self.features

    def note(self, feature: str) -> str:
        return dict(self.notes).get(feature, "")


_OUR_FEATURES = frozenset(
    {"per_head_windows", "padding", "computed_padded_queries", "dropout", "operator_dropout_mask",
     "log_sum_exp", "deterministic_backward"}
)  # fmt: skip
_LIBRARY_FEATURES = frozenset(
    {"per_head_windows", "unequal_lengths", "padding", "dropout", "log_sum_exp"}
)
# Pande's bands without the diagonal run on keys and values shifted by k, the keys shifted in
# counted as padding: routes with the operator's log-sum-exp backward serve them that way.
_SHIFTED_KEYS = ("query_excluding_bounds", "no: keys shifted as padding (band_with_global_lse)")
_LIBRARY_NOTES = (
    ("per_head_windows", "yes: heads grouped by window, one library call a group"),
    ("computed_padded_queries", "zeros, lse -inf (packed away)"),
    ("deterministic_backward", "not promised"),
    ("second_derivatives", "refused by name"),
)

ROUTE_TABLE = {
    route.name: route
    for route in (
        RouteSupport(
            "extension", "compiled C++ (CPU) and CUDA-core kernels (csrc/)",
            ("cpu", "cuda"), ALL_FLOAT_DTYPES, HeadDims(cuda_max=256), _OUR_FEATURES,
            notes=(("second_derivatives", "refused by name"), _SHIFTED_KEYS),
        ),
        RouteSupport(
            "tensor-core", "band-restricted flash attention on the tensor cores (csrc/)",
            ("cuda",), HALF_DTYPES, HeadDims(listed=(32, 64, 128)), _OUR_FEATURES, (8, 0),
            notes=(("second_derivatives", "refused by name"),),
        ),
        RouteSupport(
            "sdpa", "blocked scaled_dot_product_attention (ops/blocked_sdpa.py)",
            None, ALL_FLOAT_DTYPES, HeadDims(),
            frozenset({"per_head_windows", "padding", "computed_padded_queries"}),
            notes=(("deterministic_backward", "CPU only"),
                   ("log_sum_exp", "no: a separate logsumexp (blocked_sdpa_forward)"),
                   ("second_derivatives", "no: SDPA's fused kernels refuse them")),
        ),
        RouteSupport(
            "torch", "plain PyTorch (ops/banded_reference.py)",
            None, ALL_FLOAT_DTYPES, HeadDims(), _OUR_FEATURES | {"second_derivatives"},
            notes=(_SHIFTED_KEYS,),
        ),
        RouteSupport(
            "flash-window", "torch's FlashAttention-2 kernels with a window (ops/flash_window.py)",
            ("cuda",), HALF_DTYPES, HeadDims(listed=(32, 64, 128)), _LIBRARY_FEATURES, (8, 0),
            adapter=("flash_window", "flash_window_attention"),
            notes=_LIBRARY_NOTES + (("dropout", "the kernel's own RNG (its rng_state)"),),
        ),
        RouteSupport(
            "cudnn-band", "cuDNN's fused attention with a diagonal band (ops/cudnn_band.py)",
            ("cuda",), HALF_DTYPES, HeadDims(multiple_of=8, maximum=128), _LIBRARY_FEATURES,
            (8, 0), adapter=("cudnn_band", "cudnn_band_attention"),
            notes=_LIBRARY_NOTES + (
                ("dropout", "cuDNN's own RNG (Philox seed, offset); Tq = Tk only"),
                ("deterministic_backward", "under torch.use_deterministic_algorithms(True)"),
            ),
        ),
    )
}  # fmt: skip
LIBRARY_ROUTES = tuple(name for name, route in ROUTE_TABLE.items() if route.adapter)


def route_support(route: str) -> RouteSupport:
    try:
        return ROUTE_TABLE[route]
    except KeyError:
        raise ValueError(
            f"route table: {route!r} is not a route of banded_attention: use one of "
            f"{', '.join(ROUTE_TABLE)}"
        ) from None


def route_supports(route: str, feature: str) -> bool:
    """Whether ``route`` declares ``feature`` (a name of ``FEATURES``)."""
    return route_support(route).supports(feature)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _dtype_list(dtypes) -> str:
    names = [_dtype_name(d) for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def declared_reasons(
    route: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    needs: Iterable[str] = (),
) -> List[str]:
    """Why ``route``'s declarations exclude a call on ``device`` of ``dtype`` and ``head_dim``
    that needs the ``needs`` features; empty when they allow it."""
    support = route_support(route)
    reasons = []
    if support.devices is not None and device.type not in support.devices:
        places = " and ".join(d.upper() if d == "cuda" else d for d in support.devices)
        reasons.append(f"it runs on {places} devices only, not {device.type}")
    if dtype not in support.dtypes:
        reasons.append(f"it takes {_dtype_list(support.dtypes)}, not {_dtype_name(dtype)}")
    if not support.head_dims.allows(head_dim, device.type):
        reasons.append(f"it takes head dims {support.head_dims.describe()}, not {head_dim}")
    if (  # the device is asked only about calls that the rest of the declaration allows
        not reasons
        and support.min_capability is not None
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) < support.min_capability
    ):
        major, minor = support.min_capability
        reasons.append(f"it needs a GPU of compute capability {major}.{minor} or newer")
    for feature in needs:
        if not support.supports(feature):
            reasons.append(f"it has no {FEATURES[feature]}")
    return reasons


def _installed(module: str) -> bool:
    if module in sys.modules:  # imported already (or set aside: None)
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that cannot be imported
        return False


def library_reasons(route: str) -> List[str]:
    """Why a library route cannot run here whatever the call: its adapter or its library is
    missing (looked for, not imported)."""
    support = route_support(route)
    if support.adapter is None:
        return []
    module = f"{__package__}.{support.adapter[0]}"
    if not _installed(module):
        return [f"its adapter {module} is not installed"]
    if route == "cudnn-band" and not _installed("cudnn"):
        return ["nvidia-cudnn-frontend (the cudnn module) is not installed"]
    if route == "flash-window" and not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return [f"this torch ({torch.__version__}) has no aten._flash_attention_forward"]
    return []


def adapter(route: str):
    """The library route's adapter module (imported on first use)."""
    module, _ = route_support(route).adapter
    return importlib.import_module(f".{module}", __package__)


def adapter_attention(route: str):
    """The adapter's ``<name>_attention(q, k, v, left, right, key_padding_mask, scale,
    dropout_p) -> (out, lse)``."""
    return getattr(adapter(route), route_support(route).adapter[1])


def adapter_reasons(route, q, k, v, left, right, key_padding_mask, dropout_p) -> List[str]:
    """What the library route's adapter says it lacks for this call (its
    ``unsupported_reasons``), or why the adapter cannot be imported."""
    try:
        module = adapter(route)
    except ImportError as error:
        return [f"its adapter cannot be imported ({first_line(error)})"]
    return list(module.unsupported_reasons(q, k, v, left, right, key_padding_mask, dropout_p))


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def refusal(variable: str, route: str, reasons: Iterable[str], hint: str = "") -> str:
    """The one line that refuses a forced route: what it lacks for the call."""
    hint = f"; {hint}" if hint else ""
    return (
        f"{variable}={route} cannot take this call: {'; '.join(reasons)}{hint} (what each "
        "route takes: docs/banded_attention.md, 'Routes and dispatch')"
    )


# ---------------------------------------------------------------------------------------------
# The docs' table.

_TABLE_COLUMNS = (
    ("devices", None), ("dtypes", None), ("head dims", None), ("GPU", None),
    ("per-head windows", "per_head_windows"), ("L < 0 or R < 0", "query_excluding_bounds"),
    ("Tq != Tk", "unequal_lengths"), ("padding", "padding"),
    ("padded query rows", "computed_padded_queries"), ("dropout", "dropout"),
    ("log-sum-exp", "log_sum_exp"), ("deterministic backward", "deterministic_backward"),
    ("second derivatives", "second_derivatives"),
)  # fmt: skip


def _cell(support: RouteSupport, column: str, feature: Optional[str]) -> str:
    if column == "devices":
        return "any" if support.devices is None else ", ".join(support.devices)
    if column == "dtypes":
        return "all four" if support.dtypes == ALL_FLOAT_DTYPES else _dtype_list(support.dtypes)
    if column == "head dims":
        return support.head_dims.describe()
    if column == "GPU":
        capability = support.min_capability
        return "any" if capability is None else f"sm_{capability[0]}{capability[1]}+"
    if support.note(feature):
        return support.note(feature)
    if feature == "computed_padded_queries" and support.supports(feature):
        return "computed"
    if feature == "dropout" and support.supports("operator_dropout_mask"):
        return "the operator's keep-mask"
    return "yes" if support.supports(feature) else "no"


def support_table_markdown() -> str:
    """The route table as the markdown table of docs/banded_attention.md (a test checks that
    the docs hold exactly this)."""
    header = ["route"] + [column for column, _ in _TABLE_COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for support in ROUTE_TABLE.values():
        cells = [f"`{support.name}`"] + [_cell(support, c, f) for c, f in _TABLE_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
