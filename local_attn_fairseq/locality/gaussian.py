"""Learned Gaussian localness (Yang et al. 2018, "Modeling Localness for Self-Attention Networks").

Each Gaussian head adds to its logits (before the softmax)

    G[i, j] = -(j - P_i)^2 / (2 sigma_i^2),   sigma_i = D_i / 2,

where the centre P_i = I * sigmoid(p_i) with p_i = U_p^T tanh(W_p Q_i) (Eq. 7) and the window
D_i comes from one of four strategies:

* ``fixed``: D = ``fixed_window`` (10 in the paper);
* ``layer``: D = I * sigmoid(U_d^T tanh(W_d mean(K))) (Eq. 8), one window per sentence;
* ``query``: D_i = I * sigmoid(U_d^T tanh(W_p Q_i)) (Eq. 9, sharing W_p with the centre);
* ``head``: D = N * sigmoid(z_h), one learned scalar per head (Eq. 11, N = ``max_window``).

Where the centre and the I-scaled windows sit is one option (``centre``):

* ``paper`` (default): Eqs. 6-9 as printed, P = I sigmoid(p) and D = I sigmoid(z), the window
  kept above 1e-4. P lies in [0, I], so it can sit past the last real key (j = I - 1);
* ``code``: Yang et al.'s released code, P = (I - 1) sigmoid(p), which never passes the last
  real key, and D = I sigmoid(z) + 0.1 for the layer and query strategies (the fixed and head
  windows do not depend on I and are the same under both).

I is the real (unpadded) length and j counts real keys from the first real token, so left or
right padding changes nothing. With a causal mask, query i sees I_i = i + 1 keys (and the layer
strategy averages only those), which makes incremental decoding match the full forward pass.
A language model scored with ``fairseq-eval-lm --context-window`` sees the context as the start
of its sequence (I and j count it), as its positional embeddings do: nothing in the model's
input says where the scored block begins (docs/fairseq_features.md).
W_p is d x d on the full query (d = all heads' query width); U_p and U_d give one scalar per head.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops import mechanisms
from .constant_cache import cached_constants

WINDOW_STRATEGIES = ("fixed", "layer", "query", "head")
CENTRE_CONVENTIONS = ("paper", "code")
DEFAULT_CENTRE_CONVENTION = "paper"
MIN_WINDOW = 1e-4  # keeps sigma > 0: a window that underflows must not give 0/0
CODE_WINDOW_OFFSET = 0.1  # the released code's D = I sigmoid(z) + 0.1


def real_key_positions(key_padding_mask: Optional[Tensor], bsz: int, src_len: int, device):
    """(bsz, src_len) position of each key among the real keys, and (bsz, src_len) realness."""
    if key_padding_mask is None:
        return _unpadded_positions(bsz, src_len, torch.device(device))
    real = (~key_padding_mask.to(torch.bool)).float()
    return real.cumsum(-1) - 1, real


@cached_constants(maxsize=64)
def _unpadded_positions(bsz: int, src_len: int, device: torch.device) -> Tuple[Tensor, Tensor]:
    positions = torch.arange(src_len, device=device, dtype=torch.float32).expand(bsz, -1)
    return positions, torch.ones(bsz, src_len, device=device)


def query_lengths(real: Tensor, causal: bool, tgt_len: int, centre: str) -> Tuple[Tensor, Tensor]:
    """I, the real keys each query sees, and the span its centre may reach (I under the paper's
    convention, I - 1 under the code's), each (bsz, tgt_len), from the keys' realness (bsz,
    src_len)."""
    if causal:
        # query t sits at key position src_len - tgt_len + t and sees the keys up to it
        seen = real.cumsum(-1)[:, real.size(-1) - tgt_len :]
    else:
        seen = real.sum(-1, keepdim=True).expand(-1, tgt_len)
    # the code convention's centre reaches the last real key, I - 1, and no further
    return seen, (seen - 1).clamp_min(0) if centre == "code" else seen


@cached_constants(maxsize=64)
def _unpadded_lengths(
    bsz: int, src_len: int, tgt_len: int, causal: bool, centre: str, device: torch.device
) -> Tuple[Tensor, Tensor]:
    """:func:`query_lengths` of a batch without padding."""
    _, real = _unpadded_positions(bsz, src_len, device)
    return query_lengths(real, causal, tgt_len, centre)


class GaussianLocalness(nn.Module):
    def __init__(
        self,
        query_dim: int,
        key_dim: int,
        num_heads: int,
        strategy: str = "query",
        fixed_window: float = 10.0,
        max_window: float = 50.0,
        centre: str = DEFAULT_CENTRE_CONVENTION,
    ):
        super().__init__()
        if centre not in CENTRE_CONVENTIONS:
            raise ValueError(
                f"unknown localness centre convention {centre!r}; expected "
                f"{' or '.join(CENTRE_CONVENTIONS)}"
            )
        if strategy not in WINDOW_STRATEGIES:
            raise ValueError(
                f"unknown localness window strategy {strategy!r}; expected one of "
                f"{', '.join(WINDOW_STRATEGIES)}"
            )
        if fixed_window <= 0 or max_window <= 0:
            raise ValueError("localness windows must be positive")
        self.strategy = strategy
        self.centre = centre
        self.num_heads = num_heads
        self.fixed_window = float(fixed_window)
        self.max_window = float(max_window)
        self.w_p = nn.Linear(query_dim, query_dim, bias=False)
        self.u_p = nn.Linear(query_dim, num_heads, bias=False)
        self.w_d = nn.Linear(key_dim, key_dim, bias=False) if strategy == "layer" else None
        if strategy == "query":
            self.u_d = nn.Linear(query_dim, num_heads, bias=False)
        elif strategy == "layer":
            self.u_d = nn.Linear(key_dim, num_heads, bias=False)
        else:
            self.u_d = None
        self.z = nn.Parameter(torch.zeros(num_heads)) if strategy == "head" else None

    def centres_and_windows(
        self, q: Tensor, k: Tensor, real: Tensor, causal: bool
    ) -> Tuple[Tensor, Tensor]:
        """P and D, each (bsz, heads, tgt_len), from queries (bsz, tgt, dq), keys (bsz, src, dk)
        and the realness of the keys (bsz, src)."""
        seen, span = query_lengths(real, causal, q.size(1), self.centre)
        length, span = seen.unsqueeze(1), span.unsqueeze(1)  # I, (bsz, 1, tgt)
        hidden = torch.tanh(self.w_p(q))
        if self.strategy == "query":
            # U_p and U_d read the same hidden state: one matmul for both scalars
            both = F.linear(hidden, torch.cat([self.u_p.weight, self.u_d.weight]))
            p, z = both.transpose(1, 2).float().split(self.num_heads, dim=1)
            return span * torch.sigmoid(p), self._scaled_window(length, z)
        centre = span * torch.sigmoid(self.u_p(hidden).transpose(1, 2).float())
        if self.strategy == "fixed":
            window = torch.full_like(centre, self.fixed_window)
        elif self.strategy == "head":
            window = self._head_windows().view(1, -1, 1).expand_as(centre)
        else:
            src_len, tgt_len = k.size(1), q.size(1)
            key_sum = k * real.unsqueeze(-1).to(k.dtype)
            if causal:
                key_sum = key_sum.cumsum(1)[:, src_len - tgt_len :]
            else:
                key_sum = key_sum.sum(1, keepdim=True)
            mean_key = key_sum / seen.clamp_min(1).unsqueeze(-1).to(k.dtype)
            z = self.u_d(torch.tanh(self.w_d(mean_key))).transpose(1, 2).float()
            window = self._scaled_window(length, z).expand_as(centre)
        return centre, window

    def _head_windows(self) -> Tensor:
        """D of the head strategy (Eq. 11), (heads,)."""
        return self.max_window * torch.sigmoid(self.z.float())

    def _scaled_window(self, length: Tensor, z: Tensor) -> Tensor:
        """D = I sigmoid(z) (Eqs. 8-9), plus 0.1 under the code convention."""
        window = length * torch.sigmoid(z)
        return window + CODE_WINDOW_OFFSET if self.centre == "code" else window

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        key_padding_mask: Optional[Tensor],
        causal: bool,
        logits: Optional[Tensor] = None,
    ) -> Tuple[Tensor, Tensor, Tensor]:
        """The float32 bias G (bsz, heads, tgt_len, src_len), or ``logits + G`` in one fused
        operation when logits are given, with P and D (bsz, heads, tgt_len)."""
        bsz, src_len = k.size(0), k.size(1)
        operands = (q,) if logits is None else (q, logits)
        if self.strategy != "layer" and mechanisms.cpu_operators_apply(*operands):
            # one C++ call; P and D come back detached
            inputs = self.operator_inputs(q, src_len, key_padding_mask, causal)
            return mechanisms.gaussian_localness(inputs, logits)
        positions, real = real_key_positions(key_padding_mask, bsz, src_len, k.device)
        centre, window = self.centres_and_windows(q, k, real, causal)
        # -(j - P)^2 / (2 sigma^2) with sigma = D / 2 is -(j - P)^2 * 2 / D^2
        scale = (-2.0 / window.clamp_min(MIN_WINDOW).square()).unsqueeze(-1)
        squared_offset = (positions[:, None, None, :] - centre.unsqueeze(-1)).square()
        if logits is None:
            return squared_offset * scale, centre, window
        return torch.addcmul(logits, squared_offset, scale), centre, window

    def operator_inputs(
        self, q: Tensor, src_len: int, key_padding_mask: Optional[Tensor], causal: bool
    ) -> mechanisms.GaussianInputs:
        """This bias for queries q (bsz, tgt_len, dq) over src_len keys, as the C++ operators
        take it (ops/mechanisms.py; not for the layer strategy, whose window reads the keys)."""
        bsz, tgt_len = q.size(0), q.size(1)
        positions, real = real_key_positions(key_padding_mask, bsz, src_len, q.device)
        if key_padding_mask is None:
            seen, span = _unpadded_lengths(bsz, src_len, tgt_len, causal, self.centre, q.device)
        else:
            seen, span = query_lengths(real, causal, tgt_len, self.centre)
        window = u_d = None
        if self.strategy == "query":
            u_d = self.u_d.weight
        elif self.strategy == "head":
            window = self._head_windows()
        else:
            window = _constant_windows(self.num_heads, self.fixed_window, q.device)
        offset = CODE_WINDOW_OFFSET if self.centre == "code" and window is None else 0.0
        return mechanisms.GaussianInputs(
            q, self.w_p.weight, self.u_p.weight, u_d, span, seen, positions, window, offset,
            MIN_WINDOW,
        )  # fmt: skip


@cached_constants(maxsize=16)
def _constant_windows(heads: int, window: float, device: torch.device) -> Tensor:
    return torch.full((heads,), window, device=device)
