"""The plan of one attention layer: which path computes a call, and the layer's causality.

A layer's plan is built once, from its heads and mechanisms, when the layer is built
(``LocalMultiheadAttention.__init__``); a call asks it for its path with what varies per call (the
lengths, whether the caller gives a mask, whether the T x T weights are wanted). Every path gives
the outputs of the explicit steps 1-7 (DESIGN.md); they differ in what they build:

==================  =================================================================  ==========
path                layers                                                             T x T
==================  =================================================================  ==========
``fused``           every head global, each with its own Q/K                           none
``gaussian-sdpa``   the Gaussian bias on every head and nothing else, under             bias
                    ``LOCAL_ATTN_MECHANISM_IMPL=sdpa``
``banded``          every head local (a whole sequence attending to itself)            none
``by-head-kind``    Pande's band heads, or local heads beside global ones (a whole     none
                    sequence attending to itself, from a number of keys on)
``terms-operator``  the Gaussian bias, one kind of window or Pande's masks on every     terms
                    head and nothing else (the CPU's C++ operators)
``explicit``        anything, and every call that asks for the weights or the logits   logits
==================  =================================================================  ==========

Causality is one rule, kept here: a causal layer's query ``t`` of ``tgt_len`` new queries sits at
key position ``src_len - tgt_len + t`` (queries aligned to the last keys, as with a cache) and never
sees a later key, on every path, with or without a cache, with one or many new queries. The layer
applies it itself: the band's right side, SDPA's causal kernel, or the causal mask below. A
caller's own ``attn_mask`` is honoured exactly, on top of causality; the paths that take the
causality from the kernel alone (``banded``, ``by-head-kind``, SDPA's ``is_causal``) take only
calls without one, so a caller's mask is never swapped for a kernel's causal flag.
"""

import enum
from typing import Optional

import torch
from torch import Tensor

from ..locality.constant_cache import cached_constants
from ..locality.fixed_masks import MaskBounds, offset_mask
from ..ops import mechanisms

# Below this many keys the T x T matrices of Pande's masks are small, and one dense pass beats
# the band and log-sum-exp kernels: for forward + backward of a config (i) layer at the demo's
# sizes (128 dims, 8 heads, ~2k tokens a batch) on a 2-core CPU, the dense pass took 0.29x the
# band path's time at T = 8, 0.61x at 32, 1.41x at 48 and 4.1x at 128 (benchmarks/pande_masks.py
# --short-sequences). Both paths give the same outputs.
PANDE_BAND_MIN_KEYS = 48
# The turning point of a layer of local heads beside global heads (no Pande's band heads), whose
# by-kind path is one banded call and one fused call: six local-8 heads beside two global ones,
# embed 128, 2,048 tokens a batch, forward + backward, one thread, the explicit pass took 0.99x
# the by-kind path's time at T = 16, 1.06x at 24, 1.15x at 32 and 1.56x at 48
# (benchmarks/pande_masks.py --short-sequences --mixed; docs/benchmarks.md).
LOCAL_BESIDE_GLOBAL_MIN_KEYS = 24

_CAUSAL = (MaskBounds(None, 0),)  # keys up to the query's own position


class Path(enum.Enum):
    FUSED = "fused"
    GAUSSIAN_SDPA = "gaussian-sdpa"
    BANDED = "banded"
    BY_HEAD_KIND = "by-head-kind"
    TERMS_OPERATOR = "terms-operator"
    EXPLICIT = "explicit"


class AttentionPlan:
    """Which path serves which kind of call in one layer, and the layer's causality.

    ``plain_heads``: every head global, untied, with no mechanism; ``gaussian_only``: the Gaussian
    bias on every head and nothing else; ``fixed_masks_only``: no Gaussian bias, relative
    positions or dynamic windows; ``terms_cover_every_head``: the layers of the CPU's terms
    operator (see the module's constructor).
    """

    def __init__(
        self,
        *,
        causal: bool,
        self_attention: bool,
        banded_kernel: bool,
        plain_heads: bool,
        gaussian_only: bool,
        fixed_masks_only: bool,
        all_heads_local: bool,
        has_band_heads: bool,
        has_local_and_global_heads: bool,
        terms_cover_every_head: bool,
    ):
        self.causal = causal
        # False: local and band heads on the explicit path (for comparison and analysis)
        self.banded_kernel = banded_kernel
        self.fused = plain_heads
        self.gaussian_sdpa = gaussian_only
        band_paths = fixed_masks_only and self_attention
        self.banded = band_paths and all_heads_local and not has_band_heads
        self.by_head_kind = band_paths and (has_band_heads or has_local_and_global_heads)
        self.has_band_heads = has_band_heads
        self.terms_operator = terms_cover_every_head

    def path(
        self,
        q: Tensor,
        v: Tensor,
        src_len: int,
        attn_mask: Optional[Tensor],
        wants_matrix: bool,
    ) -> Path:
        """The path of a call with queries q (bsz, groups, tgt_len, head_dim) and values v over
        ``src_len`` keys; ``wants_matrix``: the caller asks for the weights or the logits."""
        if wants_matrix:
            return Path.EXPLICIT
        if self.fused:
            return Path.FUSED
        if self.gaussian_sdpa and mechanisms.gaussian_bias_through_sdpa():
            return Path.GAUSSIAN_SDPA
        # the band paths: a whole sequence attending to itself, causality from the band
        whole_sequence = self.banded_kernel and q.size(2) == src_len and attn_mask is None
        if whole_sequence and self.banded:
            return Path.BANDED
        if whole_sequence and self.by_head_kind and src_len >= self._by_head_kind_min_keys():
            return Path.BY_HEAD_KIND
        if (
            self.terms_operator
            and (attn_mask is None or attn_mask.dim() == 2)
            and mechanisms.cpu_operators_apply(q, v)
        ):
            return Path.TERMS_OPERATOR
        return Path.EXPLICIT

    def _by_head_kind_min_keys(self) -> int:
        return PANDE_BAND_MIN_KEYS if self.has_band_heads else LOCAL_BESIDE_GLOBAL_MIN_KEYS

    # -- causality ------------------------------------------------------------------------------
    def causal_allowed(self, tgt_len: int, src_len: int, device) -> Optional[Tensor]:
        """(tgt_len, src_len) bool, True where a query may see a key under the layer's
        causality; None when it allows every key (not causal, or one query at the newest key)."""
        if not self.causal or tgt_len == 1:
            return None
        return offset_mask(_CAUSAL, tgt_len, src_len, device)[0]

    def kernel_causal(self, attn_mask, key_padding_mask, tgt_len: int, src_len: int) -> bool:
        """Whether SDPA's causal kernel (top-left aligned, no mask) applies the layer's causality
        exactly: a whole sequence, no padding, no mask of the caller's."""
        return (
            self.causal
            and attn_mask is None
            and key_padding_mask is None
            and tgt_len == src_len > 1
        )

    def additive_mask(
        self, attn_mask: Optional[Tensor], tgt_len: int, src_len: int, dtype, device
    ) -> Optional[Tensor]:
        """The caller's additive ``attn_mask`` (tgt_len, src_len) with the layer's causality
        added (-inf at later keys), in ``dtype``; None when there is neither."""
        if self.causal and tgt_len > 1:
            causal = _causal_additive(tgt_len, src_len, dtype, torch.device(device))
            return causal if attn_mask is None else attn_mask.to(dtype) + causal
        return None if attn_mask is None else attn_mask.to(dtype)

    def rows_may_lack_keys(self, attn_mask, key_padding_mask) -> bool:
        """Whether a query may be left without any key: a caller's mask, or causality over a
        left-padded sentence (--left-pad-target)."""
        return attn_mask is not None or (self.causal and key_padding_mask is not None)


@cached_constants(maxsize=64)
def _causal_additive(tgt_len: int, src_len: int, dtype, device) -> Tensor:
    allowed = offset_mask(_CAUSAL, tgt_len, src_len, device)[0]
    zeros = torch.zeros((tgt_len, src_len), dtype=dtype, device=device)
    return zeros.masked_fill(~allowed, float("-inf"))
