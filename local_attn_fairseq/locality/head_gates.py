"""Per-head gates with the Hard Concrete L0 relaxation (Voita et al. 2019, Section 6).

Each head h has a scalar gate g_h, independent of the input, that multiplies its output before
the output projection: MultiHead = Concat(g_h head_h) W_O. In training g_h is drawn for every
batch from a Hard Concrete distribution (Louizos et al. 2018) with parameter log_alpha_h:

    u ~ U(0, 1),  s = sigmoid((log u - log(1 - u) + log_alpha) / beta),
    g = min(1, max(0, s * (zeta - gamma) + gamma))

with temperature beta (2/3 by default; Voita et al.'s own code used 0.33) and the stretch
(gamma, zeta) = (-0.1, 1.1). The clipping puts probability mass on exactly 0 and 1:

    P(g = 0) = sigmoid(beta * log(-gamma / zeta) - log_alpha)
    P(g = 1) = sigmoid(log_alpha - beta * log((1 - gamma) / (zeta - 1)))

The L0 relaxation is L_C = sum_h (1 - P(g_h = 0)), in closed form. At test time each gate is 0
or 1, whichever of P(g = 0), P(g = 1) is larger (the paper's footnote 7).

Two conventions of Voita et al.'s released code are one option away:

* initialisation (``init``): ``constant`` starts every log_alpha at ``log_alpha_init``;
  ``glorot`` draws it from U(-b, b), b = sqrt(6 / (fan_in + fan_out)) with fan_in = fan_out =
  heads, as TensorFlow's glorot_uniform does for her gate variable of shape [1, heads, 1, 1]
  (b = 0.61 for 8 heads; P(g = 0) about 0.3 at her temperature 0.33);
* the penalty's scale (``l0_penalty(model, scale)``): ``sum`` adds L_C over every gated
  attention module, as the paper writes it; ``per-layer-mean`` averages the modules' L_C, as her
  code does, so that her coefficient can be used as lambda unchanged.

Gates and probabilities are computed in float32 (at least) even in a half-precision model: in
float16 and bfloat16, 1 - 1e-6 rounds to 1, so the noise could reach log(0).
"""

import math
from typing import Dict, Iterable, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

DEFAULT_TEMPERATURE = 2.0 / 3.0
STRETCH = (-0.1, 1.1)
# log_alpha = 3 starts a gate nearly surely non-zero (P(g = 0) ~ 0.01 at beta = 2/3): gates are
# added to a converged model, which should at first keep translating as before.
DEFAULT_LOG_ALPHA_INIT = 3.0
GATE_INITS = ("constant", "glorot")
DEFAULT_GATE_INIT = "constant"
L0_PENALTY_SCALES = ("sum", "per-layer-mean")
DEFAULT_L0_PENALTY_SCALE = "sum"
# Uniform noise is kept away from 0 and 1 so that log u and log(1 - u) stay finite.
_NOISE_EPS = 1e-6


def _precise(log_alpha: Tensor) -> Tensor:
    """float32 at least: probabilities and noise of a half-precision model's gates."""
    if log_alpha.dtype in (torch.float32, torch.float64):
        return log_alpha  # no conversion: the common case, checked without an operator call
    return log_alpha.float()


class HardConcreteGates(nn.Module):
    """One Hard Concrete gate per head; ``forward()`` gives the gate values (num_heads,)."""

    def __init__(
        self,
        num_heads: int,
        temperature: float = DEFAULT_TEMPERATURE,
        log_alpha_init: float = DEFAULT_LOG_ALPHA_INIT,
        stretch: Tuple[float, float] = STRETCH,
        init: str = DEFAULT_GATE_INIT,
    ):
        super().__init__()
        gamma, zeta = stretch
        if not temperature > 0:
            raise ValueError(f"head gate temperature must be positive, got {temperature}")
        if init not in GATE_INITS:
            raise ValueError(
                f"unknown head gate initialisation {init!r}; expected {' or '.join(GATE_INITS)}"
            )
        if not (gamma < 0 and zeta > 1):
            raise ValueError(f"head gate stretch must satisfy gamma < 0 < 1 < zeta, got {stretch}")
        self.num_heads = num_heads
        self.temperature = float(temperature)
        self.gamma, self.zeta = float(gamma), float(zeta)
        self.init = init
        self.log_alpha = nn.Parameter(torch.full((num_heads,), float(log_alpha_init)))
        if init == "glorot" and num_heads:
            bound = math.sqrt(6.0 / (num_heads + num_heads))
            with torch.no_grad():
                self.log_alpha.uniform_(-bound, bound)

    def _precise_log_alpha(self) -> Tensor:
        return _precise(self.log_alpha)

    def closed_shift(self) -> float:
        """beta log(-gamma / zeta): P(g = 0) = sigmoid(closed_shift - log_alpha)."""
        return self.temperature * math.log(-self.gamma / self.zeta)

    def prob_closed(self) -> Tensor:
        """P(g_h = 0) per head, differentiable in log_alpha."""
        return torch.sigmoid(self.closed_shift() - self._precise_log_alpha())

    def prob_open(self) -> Tensor:
        """P(g_h = 1) per head."""
        shift = self.temperature * math.log((1 - self.gamma) / (self.zeta - 1))
        return torch.sigmoid(self._precise_log_alpha() - shift)

    def l0_penalty(self) -> Tensor:
        """L_C = sum_h (1 - P(g_h = 0)): the expected number of non-zero gates."""
        return _expected_open(self._precise_log_alpha(), self.closed_shift())

    def open_threshold(self) -> float:
        """The log_alpha above which P(g = 1) > P(g = 0): the two sigmoids' arguments are equal
        at the mean of their shifts."""
        closed_shift = self.temperature * math.log(-self.gamma / self.zeta)
        open_shift = self.temperature * math.log((1 - self.gamma) / (self.zeta - 1))
        return (closed_shift + open_shift) / 2

    def is_open(self) -> Tensor:
        """Bool per head: P(g = 1) > P(g = 0), the test-time gate is 1."""
        return self._precise_log_alpha() > self.open_threshold()

    def deterministic(self) -> Tensor:
        """Test-time gates: 1 where P(g = 1) > P(g = 0), else 0."""
        return self.is_open().float()

    def sample(self) -> Tensor:
        log_alpha = self._precise_log_alpha()
        # logit(u) = log u - log(1 - u), u kept in [eps, 1 - eps]: one operation instead of five
        # (noise + log_alpha) / beta as one differentiable operation: the noise is scaled in place
        inverse_temperature = 1.0 / self.temperature
        noise = torch.logit(torch.rand_like(log_alpha), eps=_NOISE_EPS).mul_(inverse_temperature)
        s = torch.sigmoid(torch.add(noise, log_alpha, alpha=inverse_temperature))
        # hardtanh, not clamp: the same values, and a backward of one operation instead of five
        # (clamp's masks of both bounds); the two differ only at exactly 0 or 1
        return F.hardtanh(s * (self.zeta - self.gamma) + self.gamma, 0.0, 1.0)

    def forward(self) -> Tensor:
        return self.sample() if self.training else self.deterministic()

    def extra_repr(self):
        return f"heads={self.num_heads}, temperature={self.temperature:.3g}, init={self.init}"


def _expected_open(log_alpha: Tensor, closed_shift: float) -> Tensor:
    # 1 - sigmoid(shift - log_alpha) = sigmoid(log_alpha - shift), without 1 - p's cancellation
    return torch.sigmoid(log_alpha - closed_shift).sum()


def _log_alphas_by(gates: Iterable[HardConcreteGates], setting) -> Dict[float, Tensor]:
    """{setting(gate): the float32 log_alphas of the gates that share it, concatenated}: one
    operation per group (a model's gates all share their settings) instead of a few per module
    and step."""
    groups: Dict[float, list] = {}
    for gate in gates:
        groups.setdefault(setting(gate), []).append(gate.log_alpha)
    return {key: _precise(torch.cat(group)) for key, group in groups.items()}


def _total(terms: list) -> Tensor:
    return terms[0] if len(terms) == 1 else torch.stack(terms).sum()


def gated_attention_modules(model: nn.Module) -> Iterable[nn.Module]:
    """The attention modules of ``model`` that carry head gates."""
    for module in model.modules():
        if getattr(module, "head_gates", None) is not None:
            yield module


def l0_penalty(model: nn.Module, scale: str = DEFAULT_L0_PENALTY_SCALE) -> Tensor:
    """L_C of every gated attention module of the model, summed (``sum``) or averaged over the
    modules (``per-layer-mean``: a layer's self- and cross-attention count as two)."""
    if scale not in L0_PENALTY_SCALES:
        raise ValueError(
            f"unknown L0 penalty scale {scale!r}; expected one of {', '.join(L0_PENALTY_SCALES)}"
        )
    gates = [m.head_gates for m in gated_attention_modules(model)]
    if not gates:
        raise ValueError(
            "the model has no head gates: train it with --head-gates (e.g. --head-gates enc)"
        )
    by_shift = _log_alphas_by(gates, HardConcreteGates.closed_shift)
    total = _total([_expected_open(log_alpha, shift) for shift, log_alpha in by_shift.items()])
    return total if scale == "sum" else total / len(gates)


def open_head_counts(model: nn.Module) -> Dict[str, Tensor]:
    """{attention type: heads whose test-time gate is open, over all its layers}, as tensors on
    the gates' device: read every step for the training log, so nothing waits for the GPU."""
    by_type: Dict[str, list] = {}
    for module in gated_attention_modules(model):
        by_type.setdefault(module.attention_type, []).append(module.head_gates)
    counts = {}
    with torch.no_grad():
        for kind, gates in by_type.items():
            by_threshold = _log_alphas_by(gates, HardConcreteGates.open_threshold)
            counts[kind] = _total([(la > t).sum() for t, la in by_threshold.items()])
    return counts


def open_heads(model: nn.Module) -> Dict[str, Dict[int, int]]:
    """{attention type: {layer: heads whose test-time gate is open}} for every gated module."""
    counts: Dict[str, Dict[int, int]] = {}
    for module in gated_attention_modules(model):
        n_open = int(module.head_gates.deterministic().sum().item())
        counts.setdefault(module.attention_type, {})[module.layer_index] = n_open
    return counts
