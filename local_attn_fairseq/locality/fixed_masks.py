"""Fixed binary head masks of Pande et al. (Section 4.1): which keys a head may attend to.

Every mask of the paper is a contiguous range of relative offsets ``d = j - i`` (key minus query
position), so a mask is stored as its bounds ``(lo, hi)``:

==============  ===============  ==========================================
name            offsets          query ``i`` attends to
==============  ===============  ==========================================
``global``      (-inf, +inf)     every key (no mask)
``identity``    [0, 0]           itself
``prev-k``      [-k, -k]         the token ``k`` places before it (``i-k``)
``next-k``      [+k, +k]         the token ``k`` places after it (``i+k``)
``band-k``      [-k, +k]         the window ``i-k .. i+k``
``local-k``     [-k, +k]         the same window, softmax renormalised in it
``local-l-r``   [-l, +r]         the window ``i-l .. i+r``, renormalised
==============  ===============  ==========================================

Pande's masks (``identity``, ``prev``, ``next``, ``band``) multiply the weights of a softmax over
all keys, so the weights inside need not sum to one (``ops.band_with_global_lse`` computes them
without a T x T matrix: the renormalised band times the softmax's mass inside it). ``local`` heads are local attention proper
(Alastruey et al.): the softmax runs over the window's keys only, and the banded operator
computes them without any T x T matrix.

The paper's text defines prev-k by ``j - i = k`` but also as the identity shifted left, and
motivates prev masks with a period attending to the tokens before it; we follow the motivation:
``prev-k`` looks back, ``next-k`` looks ahead.
"""

import re
from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from .constant_cache import cached_constants

UNBOUNDED = None
_MASK_NAME = re.compile(r"^(band|prev|next)-(-?\d+)$")
_LOCAL_NAME = re.compile(r"^local-(-?\d+)(?:-(-?\d+))?$")
MASK_SYNTAX = (
    "global, identity, band-K, prev-K, next-K, local-K or local-L-R (non-negative integers)"
)


class MaskBounds(NamedTuple):
    """Allowed relative offsets ``lo <= j - i <= hi``; ``None`` means unbounded on that side.
    ``renormalised``: the softmax runs over the allowed keys only (``local``), instead of the
    mask multiplying a softmax over all keys."""

    lo: Optional[int]
    hi: Optional[int]
    renormalised: bool = False

    @property
    def is_global(self):
        return self.lo is None and self.hi is None


def parse_mask(name: str) -> MaskBounds:
    """Bounds of a mask name; raises ValueError naming the problem for anything else."""
    if name == "global":
        return MaskBounds(UNBOUNDED, UNBOUNDED)
    if name == "identity":
        return MaskBounds(0, 0)
    local = _LOCAL_NAME.match(name) if isinstance(name, str) else None
    if local is not None:
        left = int(local.group(1))
        right = left if local.group(2) is None else int(local.group(2))
        if left < 0 or right < 0:
            raise ValueError(f"mask {name!r} has a negative window; L and R must be >= 0")
        return MaskBounds(-left, right, renormalised=True)
    match = _MASK_NAME.match(name) if isinstance(name, str) else None
    if match is None:
        raise ValueError(f"unknown mask {name!r}; expected {MASK_SYNTAX}")
    kind, k = match.group(1), int(match.group(2))
    if k < 0:
        raise ValueError(f"mask {name!r} has a negative window; K must be >= 0")
    if kind == "band":
        return MaskBounds(-k, k)
    return MaskBounds(-k, -k) if kind == "prev" else MaskBounds(k, k)


def offset_mask(
    bounds: Sequence[MaskBounds], tgt_len: int, src_len: int, device=None
) -> torch.Tensor:
    """Binary masks of shape (heads, tgt_len, src_len) for queries aligned to the last keys.

    Query ``t`` sits at position ``src_len - tgt_len + t``: for self-attention over a full
    sequence that is ``t`` itself; in incremental decoding (one query, all keys so far) it is the
    newest position. Self-attention shares one padding offset between queries and keys, so
    relative offsets are the same with fairseq's left-padded sources.

    The masks depend only on the bounds and the lengths, so each is built once and shared:
    callers must not modify the result in place.
    """
    device = torch.device("cpu" if device is None else device)
    return _offset_mask(tuple(bounds), tgt_len, src_len, device)


# Enough for every layer kind of a model times the batch lengths seen in a while; an entry of
# 8 heads x 128 x 128 keys is 128 KiB.
@cached_constants(maxsize=256)
def _offset_mask(
    bounds: Tuple[MaskBounds, ...], tgt_len: int, src_len: int, device: torch.device
) -> torch.Tensor:
    query_pos = torch.arange(src_len - tgt_len, src_len, device=device)
    key_pos = torch.arange(src_len, device=device)
    offsets = key_pos[None, :] - query_pos[:, None]  # (tgt, src): j - i
    # All heads in one comparison. An open bound is one no offset can pass: |j - i| < src_len.
    lo = [-src_len if b.lo is None else b.lo for b in bounds]
    hi = [src_len if b.hi is None else b.hi for b in bounds]
    lo, hi = (torch.tensor(x, device=device)[:, None, None] for x in (lo, hi))
    return (offsets >= lo) & (offsets <= hi)
