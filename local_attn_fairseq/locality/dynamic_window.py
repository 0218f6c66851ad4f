"""Differentiable window (Nguyen et al. 2020, "Differentiable Window for Dynamic Local Attention").

Every head points at the left and the right end of its window with two softmaxes over the keys
(Eqs. 7-8, one pair of projections per boundary, d_h = head_dim):

    phi_l = softmax((q W_L^Q)(K W_L^K)^T / sqrt(d_h)),
    phi_r = softmax((q W_R^Q)(K W_R^K)^T / sqrt(d_h)),

and turns them into the soft mask (Eq. 9), with L the upper-triangular ones, L[i, j] = [i <= j]:

    m = (phi_l^T L) * (phi_r^T L^T) + (phi_r^T L) * (phi_l^T L^T).

phi^T L is the cumulative sum P(pointer <= j) and phi^T L^T the reverse cumulative sum
P(pointer >= j), so m_j = P(l <= j) P(r >= j) + P(r <= j) P(l >= j): the expectation, for
independent l ~ phi_l and r ~ phi_r, of the discrete flag [l <= j <= r] + [r <= j <= l] (the second
term is the window of crossed pointers). Followed literally, as here, the formula counts a window
that collapsed onto one key twice: m_j = P(j lies between l and r) + P(l = r = j), which is 2 (not
1) at j when both pointers are sure of j; m lies in [0, 2].

Segment-based masking (Eqs. 10-11) puts J, J[i, j] = [i <= b * ceil(j / b)] (1-based), in place of
L: phi^T J sums phi up to the END of j's segment and phi^T J^T from the START of j's segment on, so
the keys of a segment share one mask value. Segments of b keys are counted over the real keys from
the first real one (the last segment may be shorter): a left-padded source gets the mask of the
unpadded one. A decoder cannot point into a segment that is not finished, so segments together
with a causal mask are rejected.

Pointers see only real keys. With a causal mask, query t of a tgt_len-long block sits at key
position src_len - tgt_len + t and sees the keys up to there; later keys get mask 0 exactly, so
incremental decoding equals the full forward pass. Padded keys get 0 and a query without a single
visible key an all-zero row. Everything is a cumulative sum or a gather over the keys: time and
memory O(tgt_len * src_len) per head, float32 throughout (on a GPU, for up to
MATMUL_SCAN_MAX_KEYS keys, the two cumulative sums are one product with a cached (S, 2S)
triangular matrix).

For the attention using M (Sec. 4): MW multiplies the softmax output by M; AW multiplies the local
scores by M. Apply the -inf padding / causal masks after that product, never before: M is exactly
0 on those keys and -inf * 0 is NaN.
"""

import math
import numbers
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from ..ops import mechanisms
from .constant_cache import cached_constants


def reverse_cumsum(x: Tensor) -> Tensor:
    """sum_{i >= j} x_i along the last dimension.

    Summed from the right instead of as total - cumsum + x: that difference of two numbers near 1
    cancels catastrophically for a small tail and comes out slightly negative, or non-zero on an
    all-zero tail (a causal block's future keys would then leak into the mask). Adding the
    non-negative terms from the right keeps every tail >= 0 and exactly 0 where phi is 0.
    """
    return x.flip(-1).cumsum(-1).flip(-1)


# On a GPU, PyTorch's scan along the last dimension runs far below memory speed on the many
# short rows of these masks (0.64 ms a call, half of the GPU time of a Transformer-base step on
# 8,192-token batches of short sentences, H100). Up to this many keys both sums are one float32
# product with [L | L^T] instead: the terms are non-negative, so no cancellation, and a tail of
# zeros sums to exactly 0 (with TF32 matmuls enabled by the user, the inputs are rounded to
# TF32's 10-bit mantissa first). Beyond it the product's O(S^2) work would cost more.
MATMUL_SCAN_MAX_KEYS = 256


@cached_constants(maxsize=16)
def prefix_suffix_ones(length: int, device: torch.device) -> Tensor:
    """(S, 2S) float32 [L | L^T], L[i, j] = [i <= j]: x @ it = (cumsum(x), reverse_cumsum(x))."""
    upper = torch.ones(length, length, device=device).triu_()
    return torch.cat([upper, upper.t()], dim=1)


def sums_by_product(phi: Tensor) -> Tuple[Tensor, Tensor]:
    """cumsum(phi) and reverse_cumsum(phi) along the last dimension, as one matrix product."""
    length = phi.size(-1)
    both = phi @ prefix_suffix_ones(length, phi.device)
    return both[..., :length], both[..., length:]


def prefix_and_suffix_sums(phi: Tensor) -> Tuple[Tensor, Tensor]:
    """(phi^T L, phi^T L^T): the sums of phi up to each key and from each key on, along the
    last dimension."""
    if phi.is_cuda and 0 < phi.size(-1) <= MATMUL_SCAN_MAX_KEYS:
        return sums_by_product(phi)
    return phi.cumsum(-1), reverse_cumsum(phi)


def real_keys(key_padding_mask: Optional[Tensor], bsz: int, src_len: int, device) -> Tensor:
    """(bsz, src_len) bool, True for real (unpadded) keys."""
    if key_padding_mask is None:
        return torch.ones(bsz, src_len, dtype=torch.bool, device=device)
    return ~key_padding_mask.to(device=device, dtype=torch.bool)


def segment_bounds(real: Tensor, segment_size: int) -> Tuple[Tensor, Tensor]:
    """(bsz, src_len) positions of the first and the last real key of each key's segment.

    Segments group ``segment_size`` consecutive real keys, counted from the first real key, so
    padding anywhere shifts nothing. Padded keys get some in-range position (their mask is zeroed).
    """
    src_len = real.size(-1)
    rank = real.long().cumsum(-1) - 1  # position among the real keys
    position = torch.arange(src_len, device=real.device).expand_as(rank)
    last_rank = rank[:, -1:]
    is_start = real & (rank % segment_size == 0)
    is_end = real & (((rank + 1) % segment_size == 0) | (rank == last_rank))
    # a segment starts at the latest start at or before the key and ends at the next end after it
    start = torch.where(is_start, position, -1).cummax(-1).values.clamp_min(0)
    end = torch.where(is_end, position, src_len).flip(-1).cummin(-1).values.flip(-1)
    return start, end.clamp_max(src_len - 1)


def boundary_probabilities(
    phi: Tensor, bounds: Optional[Tuple[Tensor, Tensor]]
) -> Tuple[Tensor, Tensor]:
    """P(pointer <= j) and P(pointer >= j), i.e. phi^T L and phi^T L^T (or phi^T J and phi^T J^T
    when the segment bounds are given), each shaped like phi."""
    at_most, at_least = prefix_and_suffix_sums(phi)
    if bounds is None:
        return at_most, at_least
    start, end = (b.view(b.size(0), *([1] * (phi.dim() - 2)), -1).expand_as(phi) for b in bounds)
    return at_most.gather(-1, end), at_least.gather(-1, start)


def soft_window_mask(
    phi_l: Tensor,
    phi_r: Tensor,
    segment_size: Optional[int] = None,
    key_padding_mask: Optional[Tensor] = None,
) -> Tensor:
    """The soft window mask (Eq. 9, or Eq. 11 with ``segment_size``) from pointer distributions.

    phi_l, phi_r: (bsz, ..., src_len) distributions over the keys, 0 on padded (and, for a causal
    block, on future) keys; rows may be all zero (no key). key_padding_mask: (bsz, src_len), True
    for padding. Returns float32 (bsz, ..., src_len) in [0, 2] (see the module docstring on the 2),
    0 on padded keys.
    """
    stacked = torch.stack([phi_l, phi_r], dim=1)
    return stacked_window_mask(stacked, segment_size, key_padding_mask).squeeze(1)


def stacked_window_mask(
    phi: Tensor, segment_size: Optional[int] = None, key_padding_mask: Optional[Tensor] = None
) -> Tensor:
    """:func:`soft_window_mask` of phi_l and phi_r stacked along dimension 1 (left first): the
    cumulative sums of both boundaries are taken in one pass."""
    check_segment_size(segment_size)
    phi = phi.float()
    bsz, src_len = phi.size(0), phi.size(-1)
    real = None  # the real keys, made only where they are read
    if key_padding_mask is not None or segment_size is not None:
        real = real_keys(key_padding_mask, bsz, src_len, phi.device)
    bounds = None if segment_size is None else segment_bounds(real, segment_size)
    at_most, at_least = boundary_probabilities(phi, bounds)
    left_at_most, right_at_most = at_most.chunk(2, dim=1)
    left_at_least, right_at_least = at_least.chunk(2, dim=1)
    mask = left_at_most * right_at_least + right_at_most * left_at_least
    if key_padding_mask is None:
        return mask
    return mask.masked_fill(~real.view(bsz, *([1] * (mask.dim() - 2)), src_len), 0.0)


def check_segment_size(segment_size: Optional[int]):
    if segment_size is None:
        return
    integral = isinstance(segment_size, numbers.Integral) and not isinstance(segment_size, bool)
    if not integral or segment_size < 1:
        raise ValueError(
            f"segment_size must be a positive integer (or None for token-based masking), "
            f"got {segment_size!r}"
        )


class DynamicWindow(nn.Module):
    """Per-head soft window masks M (bsz, heads, tgt_len, src_len) of Nguyen et al. 2020.

    ``segment_size=None`` gives token-based masks (Eq. 9), an integer b >= 1 segment-based ones
    (Eqs. 10-11). Set ``record = True`` to keep the last pointer distributions in
    ``last_pointers`` (detached), or call :meth:`pointers` directly.

    The left and right pointers are computed together: ``query_pointers`` holds W_L^Q (first
    heads * head_dim rows) above W_R^Q, ``key_pointers`` W_L^K above W_R^K, so one projection,
    one product and one softmax serve both boundaries.
    """

    def __init__(
        self,
        query_dim: int,
        key_dim: int,
        num_heads: int,
        head_dim: int,
        segment_size: Optional[int] = None,
    ):
        super().__init__()
        if min(query_dim, key_dim, num_heads, head_dim) < 1:
            raise ValueError(
                "dynamic window dimensions must be positive, got "
                f"query_dim={query_dim}, key_dim={key_dim}, num_heads={num_heads}, "
                f"head_dim={head_dim}"
            )
        check_segment_size(segment_size)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.segment_size = None if segment_size is None else int(segment_size)
        width = num_heads * head_dim
        self.query_pointers = nn.Linear(query_dim, 2 * width, bias=False)  # [W_L^Q; W_R^Q]
        self.key_pointers = nn.Linear(key_dim, 2 * width, bias=False)  # [W_L^K; W_R^K]
        self.record = False
        self.last_pointers: Optional[Tuple[Tensor, Tensor]] = None
        self.reset_parameters()

    def reset_parameters(self):
        # The pointers are attention logits: initialise each W like fairseq's q/k projections.
        for proj in (self.query_pointers, self.key_pointers):
            for half in proj.weight.data.chunk(2):
                nn.init.xavier_uniform_(half, gain=1 / math.sqrt(2))

    def split_heads(self, x: Tensor) -> Tensor:
        """(bsz, len, 2 * heads * head_dim) -> float32 (bsz, 2 * heads, len, head_dim): the left
        pointers' heads, then the right pointers'."""
        bsz, length, _ = x.shape
        return x.view(bsz, length, 2 * self.num_heads, self.head_dim).transpose(1, 2).float()

    def visible_keys(
        self, key_padding_mask: Optional[Tensor], causal: bool, bsz: int, tgt_len: int, src_len: int
    ) -> Optional[Tensor]:
        """(bsz, 1, tgt_len or 1, src_len) bool: the keys each query's pointers may choose, or
        None when every query sees every key."""
        device = self.query_pointers.weight.device
        visible = None
        if key_padding_mask is not None:
            visible = real_keys(key_padding_mask, bsz, src_len, device)[:, None, None, :]
        if causal:
            key_position = torch.arange(src_len, device=device)
            query_position = torch.arange(src_len - tgt_len, src_len, device=device)
            seen = key_position[None, :] <= query_position[:, None]
            visible = seen if visible is None else visible & seen
        return visible

    def project_keys(self, key: Tensor) -> Tensor:
        """[K W_L^K; K W_R^K], float32 (bsz, 2 * heads, src_len, head_dim): what incremental
        decoding caches, like the attention's own keys."""
        return self.split_heads(self.key_pointers(key))

    def both_pointers(self, query, projected_keys, visible) -> Tensor:
        """phi_l and phi_r stacked, float32 (bsz, 2 * heads, tgt_len, src_len)."""
        # float32 logits: fp16 q.k products may overflow, and the softmax needs the precision
        q = self.split_heads(self.query_pointers(query)) * self.head_dim**-0.5
        logits = q @ projected_keys.transpose(-1, -2)
        if visible is None:
            return torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(~visible, float("-inf"))
        # A query with no visible key has only -inf logits and a plain softmax gives NaN pointers
        # (exp(-inf - -inf)). Zeroing padded keys afterwards would not catch them all (a causal
        # row of a left-padded target keeps NaN on its future keys), and wherever such a mask is
        # added rather than filled in, the softmax backward carries the NaN to W_L / W_R of the
        # whole batch. Such rows get finite logits and zero pointers instead; they are found on
        # the small visibility mask, not on the logits. Always filled, never tested first: a test
        # would make the host wait for the GPU at every call.
        no_key = ~visible.any(dim=-1, keepdim=True)
        return torch.softmax(logits.masked_fill(no_key, 0.0), dim=-1).masked_fill(no_key, 0.0)

    def pointers(
        self,
        query: Tensor,
        key: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        causal: bool = False,
        projected_keys: Optional[Tensor] = None,
    ) -> Tuple[Tensor, Tensor]:
        """phi_l and phi_r (Eqs. 7-8), each float32 (bsz, heads, tgt_len, src_len), 0 outside the
        visible keys; all-zero rows for queries without any. ``projected_keys`` (from
        :meth:`project_keys`, e.g. cached while decoding) replace the projection of ``key``."""
        return self._stacked_pointers(query, key, key_padding_mask, causal, projected_keys).chunk(
            2, dim=1
        )

    def _stacked_pointers(self, query, key, key_padding_mask, causal, projected_keys):
        if projected_keys is None:
            self.check_inputs(query, key, key_padding_mask, causal)
            projected_keys = self.project_keys(key)
        bsz, tgt_len, src_len = query.size(0), query.size(1), projected_keys.size(2)
        self.check_causal(causal, tgt_len, src_len)
        visible = self.visible_keys(key_padding_mask, causal, bsz, tgt_len, src_len)
        return self.both_pointers(query, projected_keys, visible)

    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        causal: bool = False,
        projected_keys: Optional[Tensor] = None,
    ) -> Tensor:
        """query (bsz, tgt_len, query_dim), key (bsz, src_len, key_dim) or its
        ``projected_keys``, key_padding_mask (bsz, src_len) True for padding -> mask M, float32
        (bsz, heads, tgt_len, src_len)."""
        if projected_keys is None:
            self.check_inputs(query, key, key_padding_mask, causal)
            projected_keys = self.project_keys(key)
        if mechanisms.cpu_operators_apply(query, projected_keys, self.query_pointers.weight):
            window = self.operator_inputs(query, key_padding_mask, causal, projected_keys)
            mask, phi = mechanisms.dynamic_window_mask(window)
        else:
            phi = self._stacked_pointers(query, key, key_padding_mask, causal, projected_keys)
            mask = stacked_window_mask(phi, self.segment_size, key_padding_mask)
        self.keep_pointers(phi)
        return mask

    def keep_pointers(self, phi: Tensor):
        """Keeps phi_l and phi_r (stacked, as the operators give them) where ``record`` asks."""
        if self.record:
            self.last_pointers = tuple(p.detach() for p in phi.chunk(2, dim=1))

    def additive_term(
        self,
        query: Tensor,
        key_padding_mask: Optional[Tensor],
        causal: bool,
        projected_keys: Tensor,
        local: mechanisms.LocalScoreInputs,
    ) -> Tensor:
        """The additive window's term s_loc * M (Eqs. 14-16) of every head, float32 (bsz,
        heads, tgt_len, src_len): the mask and the local scores in one C++ call
        (ops/mechanisms.py), for float32 CPU tensors (:func:`mechanisms.cpu_operators_apply`)."""
        window = self.operator_inputs(query, key_padding_mask, causal, projected_keys)
        term, phi = mechanisms.additive_window_term(window, local)
        self.keep_pointers(phi)
        return term

    def operator_inputs(
        self,
        query: Tensor,
        key_padding_mask: Optional[Tensor],
        causal: bool,
        projected_keys: Tensor,
    ) -> mechanisms.WindowInputs:
        """This window for query (bsz, tgt_len, query_dim) and the projected keys, as the C++
        operators take it (ops/mechanisms.py)."""
        bsz, tgt_len, src_len = query.size(0), query.size(1), projected_keys.size(2)
        self.check_causal(causal, tgt_len, src_len)
        visible = self.visible_keys(key_padding_mask, causal, bsz, tgt_len, src_len)
        real = bounds = None
        if key_padding_mask is not None or self.segment_size is not None:
            real = real_keys(key_padding_mask, bsz, src_len, query.device)
        if self.segment_size is not None:
            bounds = segment_bounds(real, self.segment_size)
        return mechanisms.window_inputs(
            query, self.query_pointers.weight, projected_keys, visible, real, bounds
        )

    def check_inputs(self, query, key, key_padding_mask, causal):
        if query.dim() != 3 or key.dim() != 3 or query.size(0) != key.size(0):
            raise ValueError(
                "expected query (bsz, tgt_len, query_dim) and key (bsz, src_len, key_dim), got "
                f"{tuple(query.shape)} and {tuple(key.shape)}"
            )
        if key_padding_mask is not None and key_padding_mask.shape != key.shape[:2]:
            raise ValueError(
                f"key_padding_mask must be (bsz, src_len) = {tuple(key.shape[:2])}, "
                f"got {tuple(key_padding_mask.shape)}"
            )
        self.check_causal(causal, query.size(1), key.size(1))

    def check_causal(self, causal: bool, tgt_len: int, src_len: int):
        if causal and self.segment_size is not None:
            raise ValueError(
                "segment-based dynamic windows cannot be causal: a decoder cannot point to a "
                "segment that is not finished yet (Nguyen et al. 2020, Sec. 5.2); use "
                "segment_size=None (token-based masking) for decoder self-attention"
            )
        if causal and tgt_len > src_len:
            raise ValueError(
                f"a causal block of {tgt_len} queries needs at least as many keys, got {src_len}"
            )
