import math

import pytest
import torch
from torch import nn

from local_attn_fairseq.experiments.measurement import OperationCounter
from local_attn_fairseq.locality.head_gates import (
    HardConcreteGates,
    l0_penalty,
    open_head_counts,
    open_heads,
)


@pytest.mark.parametrize("temperature", [2 / 3, 0.33])
def test_sampled_zero_and_one_frequencies_match_the_closed_forms(temperature):
    torch.manual_seed(0)
    gates = HardConcreteGates(5, temperature=temperature)
    with torch.no_grad():
        gates.log_alpha.copy_(torch.tensor([-3.0, -0.5, 0.0, 0.7, 2.5]))
    samples = torch.stack([gates.sample() for _ in range(20000)]).detach()
    assert samples.min() >= 0 and samples.max() <= 1
    torch.testing.assert_close(
        (samples == 0).float().mean(0), gates.prob_closed().detach(), atol=0.012, rtol=0
    )
    torch.testing.assert_close(
        (samples == 1).float().mean(0), gates.prob_open().detach(), atol=0.012, rtol=0
    )


def test_closed_form_probabilities_match_the_stretched_concrete_cdf():
    # P(g = 0) = P(s < -gamma / (zeta - gamma)) for s ~ BinConcrete(alpha, beta).
    beta, log_alpha = 0.5, 0.3
    gates = HardConcreteGates(1, temperature=beta)
    with torch.no_grad():
        gates.log_alpha.fill_(log_alpha)
    t = 0.1 / 1.2
    cdf = 1 / (1 + math.exp(log_alpha - beta * math.log(t / (1 - t))))
    assert gates.prob_closed().item() == pytest.approx(cdf, rel=1e-6)


def test_l0_penalty_gradient_matches_finite_differences():
    gates = HardConcreteGates(4).double()
    values = torch.tensor([-1.0, 0.1, 0.5, 3.0], dtype=torch.double)
    with torch.no_grad():
        gates.log_alpha.copy_(values)
    gates.l0_penalty().backward()
    eps = 1e-6
    numeric = []
    for h in range(4):
        with torch.no_grad():
            gates.log_alpha.copy_(values)
            gates.log_alpha[h] += eps
            up = gates.l0_penalty().item()
            gates.log_alpha[h] -= 2 * eps
            down = gates.l0_penalty().item()
        numeric.append((up - down) / (2 * eps))
    torch.testing.assert_close(gates.log_alpha.grad, torch.tensor(numeric, dtype=torch.double))
    assert (gates.log_alpha.grad > 0).all()  # more open gates, more penalty


def test_test_time_gates_are_deterministic_zero_or_one():
    gates = HardConcreteGates(4)
    with torch.no_grad():
        gates.log_alpha.copy_(torch.tensor([-2.0, -0.01, 0.01, 5.0]))
    gates.eval()
    first = gates()
    assert first.tolist() == [0.0, 0.0, 1.0, 1.0]  # symmetric stretch: open iff log_alpha > 0
    assert torch.equal(first, gates())
    assert torch.equal(first, (gates.prob_open() > gates.prob_closed()).float())
    gates.train()
    torch.manual_seed(0)
    samples = torch.stack([gates() for _ in range(50)])
    assert ((samples > 0) & (samples < 1)).any()  # training draws relaxed values


@pytest.mark.parametrize(
    "kwargs", [{"temperature": 0.0}, {"temperature": -1.0}, {"stretch": (0.0, 1.1)}]
)
def test_invalid_settings_are_rejected(kwargs):
    with pytest.raises(ValueError):
        HardConcreteGates(2, **kwargs)


def test_a_sample_is_the_papers_formula_in_twelve_operations():
    """g = min(1, max(0, sigmoid((logit(u) + log_alpha) / beta) (zeta - gamma) + gamma)): the
    same values and gradients as the formula written out, forward and backward in at most 12
    operations (a training step draws every gated module's gates)."""
    gates = HardConcreteGates(64, temperature=0.33, log_alpha_init=0.0)
    with torch.no_grad():
        gates.log_alpha.uniform_(-4, 4)
    weights = torch.linspace(-1, 1, 64)
    torch.manual_seed(3)
    with OperationCounter() as operations:
        sample = gates.sample()
        sample.backward(weights)
    torch.manual_seed(3)
    u = torch.rand(64).clamp(1e-6, 1 - 1e-6)
    log_alpha = gates.log_alpha.detach().clone().requires_grad_()
    s = torch.sigmoid((torch.log(u) - torch.log(1 - u) + log_alpha) / 0.33)
    expected = torch.clamp(s * 1.2 - 0.1, 0.0, 1.0)
    expected.backward(weights)
    assert 0 < (sample == 0).sum() and 0 < (sample == 1).sum() and (sample < 1).sum() > 10
    torch.testing.assert_close(sample, expected)
    torch.testing.assert_close(gates.log_alpha.grad, log_alpha.grad)
    assert operations.count <= 12


def test_gates_are_differentiable_through_samples():
    torch.manual_seed(0)
    gates = HardConcreteGates(3, log_alpha_init=0.0)
    total = torch.stack([gates.sample() for _ in range(20)]).sum()
    total.backward()
    assert gates.log_alpha.grad is not None and (gates.log_alpha.grad > 0).all()


# -- initialisation: constant (this project) or glorot (Voita et al.'s code) --------------------
def test_constant_initialisation_is_the_default():
    gates = HardConcreteGates(8)
    assert gates.init == "constant" and torch.equal(gates.log_alpha.detach(), torch.full((8,), 3.0))
    assert gates.prob_closed().max().item() == pytest.approx(0.0100, abs=2e-4)


def test_glorot_initialised_gates_start_closed_about_30_percent_of_the_time():
    """Voita et al.'s gate variable, shape [1, 8, 1, 1], is glorot-uniform: U(-b, b) with
    b = sqrt(6 / (8 + 8)); at her temperature 0.33, P(g = 0) averages about 0.3 over the gates."""
    torch.manual_seed(0)
    heads, beta = 8, 0.33
    modules = [HardConcreteGates(heads, temperature=beta, init="glorot") for _ in range(1000)]
    log_alpha = torch.cat([g.log_alpha.detach() for g in modules])
    bound = math.sqrt(6 / (heads + heads))
    assert log_alpha.abs().max() <= bound and log_alpha.abs().max() > 0.95 * bound
    assert log_alpha.mean().abs() < 0.02
    assert log_alpha.std() == pytest.approx(bound / 3**0.5, rel=0.03)
    # E over a ~ U(-b, b) of sigmoid(c - a), c = beta log(-gamma / zeta), is
    # (softplus(c + b) - softplus(c - b)) / 2b
    c = beta * math.log(0.1 / 1.1)
    softplus = lambda x: math.log1p(math.exp(x))  # noqa: E731
    expected = (softplus(c + bound) - softplus(c - bound)) / (2 * bound)
    closed = torch.cat([g.prob_closed().detach() for g in modules])
    assert closed.mean().item() == pytest.approx(expected, abs=0.005)
    assert 0.28 < closed.mean().item() < 0.34
    sampled = torch.stack([torch.cat([g.sample().detach() for g in modules]) for _ in range(20)])
    assert (sampled == 0).float().mean().item() == pytest.approx(expected, abs=0.01)


def test_unknown_initialisation_is_rejected():
    with pytest.raises(ValueError, match="unknown head gate initialisation 'xavier'"):
        HardConcreteGates(2, init="xavier")


@pytest.mark.parametrize("stretch", [(-0.1, 1.1), (-0.2, 1.05)])
def test_open_threshold_is_where_the_open_probability_overtakes_the_closed_one(stretch):
    gates = HardConcreteGates(2000, temperature=0.33, stretch=stretch)
    with torch.no_grad():
        gates.log_alpha.uniform_(-6, 6)
        gates.log_alpha[0] = gates.open_threshold()
    assert gates.prob_open()[0].item() == pytest.approx(gates.prob_closed()[0].item())
    away = (gates.log_alpha - gates.open_threshold()).abs() > 1e-5
    by_probabilities = (gates.prob_open() > gates.prob_closed()).float()
    assert torch.equal(gates.deterministic()[away], by_probabilities[away])


def test_open_head_counts_are_tensors_that_agree_with_open_heads():
    class Gated(nn.Module):
        def __init__(self, attention_type, layer_index, log_alpha):
            super().__init__()
            self.attention_type, self.layer_index = attention_type, layer_index
            self.head_gates = HardConcreteGates(len(log_alpha))
            with torch.no_grad():
                self.head_gates.log_alpha.copy_(torch.tensor(log_alpha))

    model = nn.ModuleList(
        [Gated("encoder_self", 0, [1.0, -1.0, 2.0]), Gated("encoder_self", 1, [-3.0, 0.5, -0.5]),
         Gated("decoder_cross", 0, [-1.0, -2.0, -0.1])]
    )  # fmt: skip
    counts = open_head_counts(model)
    assert all(isinstance(c, torch.Tensor) and not c.requires_grad for c in counts.values())
    assert {kind: int(c) for kind, c in counts.items()} == {"encoder_self": 3, "decoder_cross": 0}
    assert open_heads(model) == {"encoder_self": {0: 2, 1: 1}, "decoder_cross": {0: 0}}


class GatedModule(nn.Module):
    def __init__(self, attention_type, heads, dtype=torch.float32, **settings):
        super().__init__()
        self.attention_type, self.layer_index = attention_type, 0
        self.head_gates = HardConcreteGates(heads, **settings).to(dtype)
        with torch.no_grad():
            self.head_gates.log_alpha.uniform_(-3, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_the_model_penalty_and_counts_are_the_modules_own_in_a_few_operations(dtype):
    """Gates of one setting are taken together (one concatenation, sigmoid and sum for the
    whole model); gates of other settings in their own group; same values and gradients as
    each module's own L_C and open heads."""
    torch.manual_seed(0)
    model = nn.ModuleList(
        [GatedModule("encoder_self", 8, dtype) for _ in range(5)]
        + [GatedModule("decoder_cross", 4, dtype, temperature=0.33) for _ in range(2)]
        + [GatedModule("decoder_cross", 8, dtype, stretch=(-0.2, 1.05))]
    )
    gates = [m.head_gates for m in model]
    for scale, divisor in (("sum", 1), ("per-layer-mean", len(gates))):
        penalty = l0_penalty(model, scale)
        per_module = torch.stack([g.l0_penalty() for g in gates]).sum() / divisor
        expected = torch.stack([(1 - g.prob_closed()).sum() for g in gates]).sum() / divisor
        assert penalty.dtype == torch.float32
        torch.testing.assert_close(penalty, per_module)
        torch.testing.assert_close(penalty, expected)
        grads = torch.autograd.grad(penalty, [g.log_alpha for g in gates])
        expected_grads = torch.autograd.grad(expected, [g.log_alpha for g in gates])
        for grad, want in zip(grads, expected_grads):
            torch.testing.assert_close(grad, want)
    counts = {kind: int(c) for kind, c in open_head_counts(model).items()}
    per_type = {}
    for m in model:
        per_type[m.attention_type] = per_type.get(m.attention_type, 0) + int(
            m.head_gates.is_open().sum()
        )
    assert counts == per_type and 0 < counts["encoder_self"] < 40
    with OperationCounter() as operations:
        l0_penalty(model).backward()
    assert operations.count <= 25  # three groups; per module it was about 8 a module
