"""Layer-wise token contributions of encoder self-attention and the windows they suggest
(Alastruey et al. 2022, Section 3 and Algorithm 1; after Kobayashi et al. 2021).

Contributions (Eqs. 3-5). A pre-LN attention block computes, for frames x_1..x_N,

    x^_i = sum_j sum_h A^h_ij (LN(x_j) W^h_V + b^h_V) W^h_O + b_O + x_i = sum_j F_i(x_j) + b_O

with F_i(x_j) = sum_h A^h_ij (LN(x_j) W^h_V + b^h_V) W^h_O, plus the residual x_i when j = i.
LayerNorm is applied to each frame on its own (its mean and variance are those of x_j), so
LN(x_j) is exactly what the model computes, learned gain and bias included; the value bias b_V
rides with each x_j (the weights of a row sum to one, so this is exact); b_O belongs to no frame
and stays out of F, as in the paper's Eq. 4. The contribution of x_j to x^_i is
C_ij = ||F_i(x_j)||, and each row is normalised to sum to one (so that the paper's D and
CL = 1 - D are shares of a frame's total contribution).

Per-head weights A^h come from the attention module itself (``need_head_weights=True``, its
explicit path: the same weights as the banded operator's, which never returns them), so the
model is never re-implemented here. Norms are computed through the per-frame Gram matrices of
the heads' transformed values, O(N^2 H^2) instead of the O(N^2 d) of materialising every F_i(x_j).

Diagonality (Eq. 6): D(w) = 1/N sum_i sum_{|j - i| <= floor(w / 2)} C_ij for w = 1 .. 2N; w = 1 is
the main diagonal, w >= 2N - 1 the whole matrix. CCD is the area under D over w in [1, 2N]
(trapezoidal rule), divided by the width of that range, 2N - 1, so that it lies in (0, 1] and
sentences of different lengths can be averaged.

Window selection (Algorithm 1): walking away from the main diagonal, the sentence's width grows
whenever the mean of the i-th super- or sub-diagonal of C exceeds the threshold t (0.01), and the
walk stops after ceil(N / 10) consecutive offsets below t. The width recorded for the last such
offset i follows one of two conventions:

* ``2i`` (default): the width Table 1's statistics were computed from. Its means are not reachable
  with odd widths (layer 5 of En-De: 4.03 +- 0.28, while every odd value is at least 0.97 from
  4.03, so odd widths have a standard deviation of at least 0.97); with even widths they are
  (mostly 4, i.e. i = 2), and w_l = ceil(4.03 + 0.28) = 5 is the paper's window. A sentence
  with no off-diagonal above t has i = 0, width 0.
* ``2i+1``: Algorithm 1 as printed, w = 2i + 1; the main diagonal itself (about 65% of a row)
  is not tested, so a sentence with no off-diagonal above t gets 0, not 1. Widths come out one
  larger wherever any offset passes, and the chosen windows often two larger (layer 5: 7).

Over a sample of sentences, w_l = ceil(mu_l + sigma_l) (population standard deviation), plus one
if even (the window is centred on the frame), and the contribution loss of that window is
CL = 1 - D(w_l).
"""

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from .loading import self_attention

DEFAULT_THRESHOLD = 0.01  # the paper's t
# Tables 1, 3 and 4 of the paper: the layers it keeps global have CL >= 0.27, those it makes
# local CL <= 0.24.
DEFAULT_MAX_CONTRIBUTION_LOSS = 0.25
# Algorithm 1's per-sentence width for the last offset i above t (see the module docstring).
WIDTH_CONVENTIONS = ("2i", "2i+1")
DEFAULT_WIDTH_CONVENTION = "2i"


# -- the decomposition ------------------------------------------------------------------------
@dataclass
class SentencePieces:
    """One sentence's attention block, real frames only: enough to rebuild its output."""

    inputs: Tensor  # x_j, (N, d): the block's input, which is also its residual
    weights: Tensor  # A^h_ij, (H, N, N)
    head_values: Tensor  # (LN(x_j) W^h_V + b^h_V) W^h_O, (H, N, d)
    out_bias: Optional[Tensor]  # b_O, (d,)


def transformed_vectors(pieces: SentencePieces) -> Tensor:
    """F_i(x_j) for every i, j: (N, N, d). O(N^2 d) memory: for checks on short inputs."""
    vectors = torch.einsum("hij,hjd->ijd", pieces.weights, pieces.head_values)
    diag = torch.arange(vectors.shape[0], device=vectors.device)
    vectors[diag, diag] += pieces.inputs
    return vectors


def block_output(pieces: SentencePieces) -> Tensor:
    """sum_j F_i(x_j) + b_O (Eq. 4): what the attention block outputs, residual included."""
    out = torch.einsum("hij,hjd->id", pieces.weights, pieces.head_values) + pieces.inputs
    return out if pieces.out_bias is None else out + pieces.out_bias


def contribution_matrix(pieces: SentencePieces) -> Tensor:
    """C_ij = ||F_i(x_j)|| (N, N), in float64, without building the (N, N, d) vectors."""
    weights = pieces.weights.double()
    values = pieces.head_values.double()
    inputs = pieces.inputs.double()
    gram = torch.einsum("hjd,gjd->jhg", values, values)  # <VO^h_j, VO^g_j>
    squared = torch.einsum("hij,gij,jhg->ij", weights, weights, gram)
    # j = i adds the residual: ||y + x_i||^2 = ||y||^2 + 2 <y, x_i> + ||x_i||^2
    diagonal = weights.diagonal(dim1=1, dim2=2)  # (H, N): A^h_ii
    cross = torch.einsum("hi,hid,id->i", diagonal, values, inputs)
    diag = torch.arange(squared.shape[0], device=squared.device)
    squared[diag, diag] += 2 * cross + (inputs * inputs).sum(-1)
    return squared.clamp_min(0).sqrt()


def normalise_rows(contributions: Tensor) -> Tensor:
    """Each frame's contributions as shares of its total (rows sum to one)."""
    totals = contributions.sum(dim=-1, keepdim=True)
    return contributions / totals.clamp_min(torch.finfo(contributions.dtype).tiny)


# -- diagonality, CCD, Algorithm 1 ------------------------------------------------------------
def diagonal_sums(contributions: Tensor) -> Tensor:
    """Sum of every diagonal, offsets -(N-1) .. N-1 (index d + N - 1 holds j - i = d)."""
    n = contributions.shape[0]
    offsets = (torch.arange(n)[None, :] - torch.arange(n)[:, None] + n - 1).flatten()
    sums = torch.zeros(2 * n - 1, dtype=contributions.dtype)
    return sums.index_add_(0, offsets, contributions.flatten())


def offset_means(contributions: Tensor) -> Tensor:
    """Mean of every diagonal (same indexing as ``diagonal_sums``)."""
    n = contributions.shape[0]
    return diagonal_sums(contributions) / (n - (torch.arange(2 * n - 1) - (n - 1)).abs())


def diagonality(contributions: Tensor) -> Tensor:
    """D(w) for w = 1 .. 2N (Eq. 6), from row-normalised contributions: entry w - 1."""
    n = contributions.shape[0]
    sums = diagonal_sums(contributions)
    # both diagonals at distance k; then the total within |j - i| <= k, for k = 0 .. N - 1
    pairs = sums[n - 1 :] + torch.cat([sums.new_zeros(1), sums[: n - 1].flip(0)])
    within = pairs.cumsum(0) / n
    half_widths = torch.clamp(torch.arange(1, 2 * n + 1) // 2, max=n - 1)
    return within[half_widths]


def window_diagonality(contributions: Tensor, window: int) -> float:
    """D(w) of one window; w = 0 (global attention) keeps everything."""
    n = contributions.shape[0]
    if window == 0 or window >= 2 * n - 1:
        return 1.0
    return float(diagonality(contributions)[window - 1])


def contribution_loss(contributions: Tensor, window: int) -> float:
    """CL(l, w) = 1 - D(l, w): the share of the contributions a window leaves out."""
    return 1.0 - window_diagonality(contributions, window)


def cumulative_diagonality(curve: Tensor) -> float:
    """CCD: trapezoidal area under D(w), w = 1 .. 2N, over the range's width 2N - 1."""
    if curve.numel() < 2:
        return float(curve.sum())
    area = float(((curve[1:] + curve[:-1]) / 2).sum())
    return area / (curve.numel() - 1)


def window_size(
    contributions: Tensor,
    threshold: float = DEFAULT_THRESHOLD,
    convention: str = DEFAULT_WIDTH_CONVENTION,
) -> int:
    """Algorithm 1 on one row-normalised contribution matrix: the sentence's width, 2i or
    2i + 1 for the last offset i above the threshold, and 0 when no offset passes."""
    if convention not in WIDTH_CONVENTIONS:
        raise ValueError(
            f"unknown window width convention {convention!r}; expected "
            f"{' or '.join(WIDTH_CONVENTIONS)}"
        )
    n = contributions.shape[0]
    if n < 2:
        return 0
    means = offset_means(contributions)
    centre = n - 1
    above = (means[centre + 1 :] > threshold) | (means[:centre].flip(0) > threshold)  # i = 1..
    patience = max(1, math.ceil(n / 10))
    last = 0  # the main diagonal (i = 0) starts the count
    for i in (above.nonzero().flatten() + 1).tolist():
        if i - last - 1 >= patience:
            break
        last = i
    if last == 0:
        return 0
    return 2 * last if convention == "2i" else 2 * last + 1


def odd_window(windows: Sequence[int]) -> int:
    """w_l = ceil(mu_l + sigma_l) over the sample, made odd (centred on the frame)."""
    mean, std = float(np.mean(windows)), float(np.std(windows))
    w = math.ceil(mean + std - 1e-9)  # no spurious +1 from float noise on whole numbers
    return w + 1 if w % 2 == 0 else w


# -- the encoder, through hooks -----------------------------------------------------------------
def encoder_layers(model) -> List[torch.nn.Module]:
    """The self-attention layers of an encoder-decoder model (S2T or text Transformer)."""
    encoder = getattr(model, "encoder", model)
    for name in ("transformer_layers", "layers"):
        layers = getattr(encoder, name, None)
        if layers is not None:
            return [getattr(layer, "module", layer) for layer in layers]
    raise ValueError(f"{type(encoder).__name__} has no transformer_layers or layers to analyse")


def check_decomposable(layers) -> None:
    for index, layer in enumerate(layers):
        if not getattr(layer, "normalize_before", False):
            raise ValueError(
                f"encoder layer {index} normalises after the residual (post-LN); the "
                "decomposition here is the pre-LN one of Alastruey et al. (train with "
                "--encoder-normalize-before, as fairseq's S2T models do)"
            )
        positions = getattr(layer.self_attn, "relative_positions", None)
        if positions is not None and getattr(positions, "value_embeddings", None) is not None:
            raise ValueError(
                f"encoder layer {index} adds relative position values to its output, which "
                "belong to no single frame; contributions are not defined for it"
            )


def head_values(attention, normed: Tensor) -> Tensor:
    """(LN(x_j) W^h_V + b^h_V) W^h_O of every head: (B, H, T, d) from LN(x) (T, B, d)."""
    length, bsz, _ = normed.shape
    heads, dim = attention.num_heads, attention.head_dim
    values = attention.v_proj(normed).view(length, bsz, heads, dim)
    gates = getattr(attention, "head_gates", None)
    if gates is not None:  # Voita et al.'s gates scale each head's output before W_O
        values = values * gates().to(values.dtype)[None, None, :, None]
    w_out = attention.out_proj.weight.view(-1, heads, dim)  # (d, H, head_dim)
    return torch.einsum("tbhk,dhk->bhtd", values, w_out)


def layer_pieces(layer, inputs: Tensor, padding_mask: Optional[Tensor]) -> List[SentencePieces]:
    """Each sentence's pieces of one pre-LN encoder layer, from the layer's input (T, B, d)."""
    attention = layer.self_attn
    normed = layer.self_attn_layer_norm(inputs)
    # A^h (H, B, T, T) from the module's own explicit path
    _, weights = self_attention(attention, normed, padding_mask, head_weights=True)
    values = head_values(attention, normed)
    pieces = []
    for b in range(inputs.shape[1]):
        real = torch.ones(inputs.shape[0], dtype=torch.bool, device=inputs.device)
        if padding_mask is not None:
            real = ~padding_mask[b].bool()
        pieces.append(
            SentencePieces(
                inputs=inputs[real, b],
                weights=weights[:, b][:, real][:, :, real],
                head_values=values[b][:, real],
                out_bias=attention.out_proj.bias,
            )
        )
    return pieces


class LayerInputs:
    """Records the input and padding mask of every encoder layer during a forward pass."""

    def __init__(self, layers):
        self.layers = layers
        self.captured: Dict[int, tuple] = {}
        self._handles = []

    def __enter__(self):
        for index, layer in enumerate(self.layers):
            self._handles.append(
                layer.register_forward_pre_hook(self._hook(index), with_kwargs=True)
            )
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, index):
        def record(module, args, kwargs):
            x = args[0] if args else kwargs["x"]
            mask = args[1] if len(args) > 1 else kwargs.get("encoder_padding_mask")
            self.captured[index] = (x.detach(), None if mask is None else mask.detach())

        return record


def encoder_pieces(model, net_input: dict) -> List[List[SentencePieces]]:
    """[layer][sentence] pieces of one batch, running the encoder as the model does."""
    layers = encoder_layers(model)
    check_decomposable(layers)
    with torch.no_grad(), LayerInputs(layers) as recorder:
        model.encoder(src_tokens=net_input["src_tokens"], src_lengths=net_input["src_lengths"])
        return [layer_pieces(layer, *recorder.captured[i]) for i, layer in enumerate(layers)]


# -- statistics over a sample -----------------------------------------------------------------
@dataclass
class LayerSample:
    """What Algorithm 1, CCD and CL need of each analysed sentence of one layer."""

    width_convention: str = DEFAULT_WIDTH_CONVENTION
    windows: List[int] = field(default_factory=list)
    ccd: List[float] = field(default_factory=list)
    curves: List[Tensor] = field(default_factory=list)  # D(w), w = 1 .. 2N, per sentence

    def add(self, contributions: Tensor, threshold: float) -> None:
        curve = diagonality(contributions)
        self.windows.append(window_size(contributions, threshold, self.width_convention))
        self.ccd.append(cumulative_diagonality(curve))
        self.curves.append(curve.float())

    def losses(self, window: int) -> List[float]:
        return [
            0.0 if window == 0 or window > curve.numel() else 1.0 - float(curve[window - 1])
            for curve in self.curves
        ]

    def summary(self, layer: int) -> dict:
        window = odd_window(self.windows)
        losses = self.losses(window)
        return {
            "layer": layer,
            "window_mean": float(np.mean(self.windows)),
            "window_std": float(np.std(self.windows)),
            "window": window,
            "contribution_loss_mean": float(np.mean(losses)),
            "contribution_loss_std": float(np.std(losses)),
            "ccd_mean": float(np.mean(self.ccd)),
            "ccd_std": float(np.std(self.ccd)),
            "sentences": len(self.windows),
            "longest": max(curve.numel() // 2 for curve in self.curves),
        }


def choose_windows(
    summaries: Sequence[dict],
    max_contribution_loss: float = DEFAULT_MAX_CONTRIBUTION_LOSS,
    global_layers: Optional[int] = None,
) -> List[int]:
    """The --encoder-attention-windows value: w_l per layer, 0 where attention stays global.

    Global: with ``global_layers`` the first that many layers (the paper's choice, three of
    twelve); otherwise every layer whose window leaves out at least ``max_contribution_loss``
    of the contributions (Tables 1, 3, 4 separate the paper's global layers at 0.25). A window
    that covers every analysed sentence whole also becomes global: it would save nothing.
    """
    chosen = []
    for index, s in enumerate(summaries):
        if global_layers is not None:
            is_global = index < global_layers
        else:
            is_global = s["contribution_loss_mean"] >= max_contribution_loss
        if s["window"] >= 2 * s["longest"] - 1:
            is_global = True
        chosen.append(0 if is_global else s["window"])
    return chosen
