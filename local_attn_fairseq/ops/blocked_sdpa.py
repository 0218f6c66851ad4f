"""Banded attention through PyTorch's ``scaled_dot_product_attention``, in blocks of queries.

The queries are cut into blocks of ``block`` consecutive positions. Block n (queries
s .. s + block - 1, s = n * block) gets the keys s - max_left .. s + block - 1 + max_right: every
key any of its queries may see, zero-padded past the sequence's ends. The blocks go into the
batch dimension, and one SDPA call with the exact band as a boolean mask (per-head windows, key
padding, keys past the ends) does all of them, so that PyTorch's own kernels (flash on the CPU;
memory-efficient or cuDNN, on tensor cores, on a GPU) do the work. Backward is SDPA's, through
autograd. Memory and time are O(T * (block + w)): the rectangle of each block, not T x T.

Semantics are the operator's (``banded_reference``): a query with no allowed key gets zeros and
zero gradients (its row is given one harmless key for SDPA, which returns NaN or zeros for a
row without any, depending on the backend, and is zeroed afterwards). Not covered: the
operator's dropout, whose band-layout keep-mask SDPA cannot take; callers use this route only
with dropout_p == 0 (the dispatch in ``banded_attention`` sends other calls elsewhere).

SDPA does not return the row log-sum-exp. ``blocked_sdpa_forward`` computes it with a separate
``logsumexp`` over each block's logits (one more product of the size of the forward's first);
``blocked_sdpa_output`` skips it.
"""

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .banded_reference import compute_dtype

# Key windows are rounded up to a multiple of this: CUDA's memory-efficient kernel wants the
# mask's last dimension aligned (it would otherwise pad a copy of the mask on every call).
KEY_ALIGNMENT = 8
MIN_BLOCK, MAX_BLOCK = 16, 128


def default_block(width: int, length: int) -> int:
    """Queries per block: the power of two at or above the band width, within [16, 128] and at
    most T. Wider blocks waste more of each rectangle (it holds block + W - 1 keys for a band
    of W); narrower ones make SDPA's matrices too small to run well."""
    block = MIN_BLOCK
    while block < width and block < MAX_BLOCK:
        block *= 2
    return max(1, min(block, length))


class BlockLayout:
    """Shapes of the blocked problem: n_blocks blocks of `block` queries, `keys` keys each."""

    def __init__(self, length: int, left: Sequence[int], right: Sequence[int], block: int):
        self.length, self.block = length, block
        self.max_left, self.max_right = max(left), max(right)
        self.n_blocks = -(-length // block)
        span = block + self.max_left + self.max_right
        self.keys = -(-span // KEY_ALIGNMENT) * KEY_ALIGNMENT
        # Zero keys before the first and after the last position, so that block n's keys are
        # rows n * block .. n * block + keys - 1 of the padded sequence.
        self.pad_before = self.max_left
        self.pad_after = (self.n_blocks - 1) * block + self.keys - self.max_left - length

    def query_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, T, D) -> (B * n_blocks, H, block, D), queries past T zero."""
        batch, heads, _, dim = x.shape
        padded = F.pad(x, (0, 0, 0, self.n_blocks * self.block - self.length))
        blocks = padded.view(batch, heads, self.n_blocks, self.block, dim)
        return blocks.transpose(1, 2).reshape(batch * self.n_blocks, heads, self.block, dim)

    def key_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, T, D) -> (B * n_blocks, H, keys, D): each block's key window."""
        batch, heads, _, dim = x.shape
        padded = F.pad(x, (0, 0, self.pad_before, self.pad_after))
        windows = padded.unfold(2, self.keys, self.block)  # (B, H, n_blocks, D, keys)
        windows = windows.permute(0, 2, 1, 4, 3)  # (B, n_blocks, H, keys, D)
        return windows.reshape(batch * self.n_blocks, heads, self.keys, dim)

    def unblock(self, out: torch.Tensor, batch: int) -> torch.Tensor:
        """(B * n_blocks, H, block, X) -> (B, H, T, X)."""
        _, heads, _, last = out.shape
        blocks = out.view(batch, self.n_blocks, heads, self.block, last).transpose(1, 2)
        return blocks.reshape(batch, heads, self.n_blocks * self.block, last)[:, :, : self.length]

    def allowed(
        self,
        batch: int,
        left: Sequence[int],
        right: Sequence[int],
        key_padding_mask: Optional[torch.Tensor],
        device: torch.device,
    ) -> torch.Tensor:
        """(B * n_blocks, H, block, keys) bool: query r of block n may attend to its key c."""
        block_start = torch.arange(self.n_blocks, device=device) * self.block
        row = torch.arange(self.block, device=device)
        col = torch.arange(self.keys, device=device)
        offset = col[None, :] - self.max_left - row[:, None]  # j - i, (block, keys)
        lefts = torch.tensor(list(left), device=device).view(-1, 1, 1)
        rights = torch.tensor(list(right), device=device).view(-1, 1, 1)
        in_window = (offset >= -lefts) & (offset <= rights)  # (H, block, keys)
        key = block_start[:, None] - self.max_left + col[None, :]  # (n_blocks, keys)
        in_sequence = (key >= 0) & (key < self.length)
        allowed = in_window[None] & in_sequence[:, None, None, :]  # (n_blocks, H, block, keys)
        if key_padding_mask is None:
            allowed = allowed.unsqueeze(0).expand(batch, *allowed.shape)
        else:
            padded = F.pad(key_padding_mask.bool(), (self.pad_before, self.pad_after), value=True)
            padding = padded.unfold(1, self.keys, self.block)  # (B, n_blocks, keys)
            allowed = allowed.unsqueeze(0) & ~padding[:, :, None, None, :]
        return allowed.reshape(batch * self.n_blocks, *allowed.shape[2:])


def _check_no_dropout(dropout_keep: Optional[torch.Tensor], dropout_p: float) -> None:
    if dropout_p != 0.0 or dropout_keep is not None:
        raise ValueError(
            "blocked SDPA route: the operator's dropout (a band-layout keep-mask) cannot be "
            f"given to scaled_dot_product_attention; call it with dropout_p = 0 (got {dropout_p})"
        )


def _blocked_attention(q, k, v, left, right, key_padding_mask, scale, block):
    """Output (B, H, T, D) and, for the log-sum-exp, the blocked q, k and mask."""
    batch, _, length, _ = q.shape
    block = block or default_block(max(left) + max(right) + 1, length)
    layout = BlockLayout(length, left, right, block)
    q_blocks, k_blocks = layout.query_blocks(q), layout.key_blocks(k)
    allowed = layout.allowed(batch, left, right, key_padding_mask, q.device)
    has_key = allowed.any(-1, keepdim=True)
    # A row without keys sees key column 0 (a real or zero-padded key: finite), then is zeroed.
    first_column = torch.arange(layout.keys, device=q.device) == 0
    sdpa_mask = allowed | (~has_key & first_column)
    out = F.scaled_dot_product_attention(
        q_blocks, k_blocks, layout.key_blocks(v), attn_mask=sdpa_mask, scale=scale
    )
    out = torch.where(has_key, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return layout.unblock(out, batch), (layout, q_blocks, k_blocks, allowed)


def blocked_sdpa_output(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    left: Sequence[int],
    right: Sequence[int],
    key_padding_mask: Optional[torch.Tensor],
    scale: float,
    block: Optional[int] = None,
) -> torch.Tensor:
    """Banded attention (B, H, T, D) in q's dtype, differentiable; no dropout, no lse.

    `left`/`right` are per-head windows already clipped to T - 1 (as ``banded_attention`` passes
    them); `block` defaults to ``default_block``.
    """
    out, _ = _blocked_attention(q, k, v, left, right, key_padding_mask, scale, block)
    return out


def blocked_sdpa_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    left: Sequence[int],
    right: Sequence[int],
    key_padding_mask: Optional[torch.Tensor],
    dropout_keep: Optional[torch.Tensor],
    scale: float,
    dropout_p: float,
    block: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The operator's contract (``local_attn::banded_forward``) through SDPA, dropout_p = 0 only.

    Returns the output (differentiable) and the row log-sum-exp (B, H, T) in the compute dtype,
    -inf for a row without keys (not differentiable, as the operator's).
    """
    _check_no_dropout(dropout_keep, dropout_p)
    out, (layout, q_blocks, k_blocks, allowed) = _blocked_attention(
        q, k, v, left, right, key_padding_mask, scale, block
    )
    with torch.no_grad():
        acc = compute_dtype(q.dtype)
        logits = q_blocks.to(acc) @ k_blocks.to(acc).transpose(-1, -2) * scale
        lse = logits.masked_fill(~allowed, float("-inf")).logsumexp(-1, keepdim=True)
    return out, layout.unblock(lse, q.shape[0]).squeeze(-1)
