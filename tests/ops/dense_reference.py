"""Dense float64 banded attention for the tests: the obvious T x T computation, masks and all."""

import torch


def per_head(window, heads):
    values = window.tolist() if isinstance(window, torch.Tensor) else window
    values = [values] * heads if isinstance(values, int) else list(values)
    return torch.tensor(values, dtype=torch.long).view(heads, 1, 1)


def dense_allowed(batch, heads, length, left, right, key_padding_mask=None):
    """(B, H, T, T) bool: query i may attend to key j."""
    offset = torch.arange(length)[None, :] - torch.arange(length)[:, None]  # j - i
    allowed = (offset >= -per_head(left, heads)) & (offset <= per_head(right, heads))
    allowed = allowed.unsqueeze(0).expand(batch, heads, length, length)
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask.bool()[:, None, None, :]
    return allowed


def band_columns(length, max_left, width):
    """(T, W) key index of each band column, and whether it lies inside the sequence."""
    key = torch.arange(length)[:, None] - max_left + torch.arange(width)[None, :]
    return key.clamp(0, max(length - 1, 0)), (key >= 0) & (key < length)


def band_to_dense(band, max_left):
    """A (B, H, T, W) band tensor as (B, H, T, T), zero outside the band."""
    batch, heads, length, width = band.shape
    key, inside = band_columns(length, max_left, width)
    dense = torch.zeros(batch, heads, length, length, dtype=band.dtype)
    index = key.expand(batch, heads, length, width)
    return dense.scatter_add(-1, index, band * inside.to(band.dtype))


def dense_to_band(dense, max_left, max_right):
    """The band layout (B, H, T, max_left + max_right + 1) of a (B, H, T, T) tensor."""
    batch, heads, length, _ = dense.shape
    width = max_left + max_right + 1
    key, inside = band_columns(length, max_left, width)
    gathered = dense.gather(-1, key.expand(batch, heads, length, width))
    return gathered * inside.to(dense.dtype)


def dense_attention(
    q, k, v, left, right, key_padding_mask=None, scale=None, keep=None, dropout_p=0.0
):
    """Output and pre-dropout weights (B, H, T, T) in float64; `keep` is a band-layout mask
    whose band was sized by the windows clipped to T - 1 (as the operator draws it)."""
    q, k, v = (t.double() for t in (q, k, v))
    batch, heads, length, dim = q.shape
    scale = dim**-0.5 if scale is None else scale
    allowed = dense_allowed(batch, heads, length, left, right, key_padding_mask)
    logits = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    has_key = allowed.any(-1, keepdim=True)
    weights = torch.softmax(logits.masked_fill(~has_key, 0.0), dim=-1).masked_fill(~allowed, 0)
    applied = weights
    if keep is not None:
        reach = max(length - 1, 0)
        band_left = min(int(per_head(left, heads).max()), reach)
        factor = 1.0 / (1.0 - dropout_p) if dropout_p < 1.0 else 0.0
        applied = weights * band_to_dense(keep.double(), band_left) * factor
    return applied @ v, weights
