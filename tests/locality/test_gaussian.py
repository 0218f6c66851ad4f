import pytest
import torch

from local_attn_fairseq.locality.gaussian import GaussianLocalness

D, H = 12, 3


def module(strategy):
    torch.manual_seed(0)
    return GaussianLocalness(D, D, H, strategy, fixed_window=4.0, max_window=20.0)


def direct(g, q, k, pad, causal):
    """G written out entry by entry from Yang et al. Eqs. 5-11."""
    bsz, tgt, _ = q.shape
    src = k.shape[1]
    out = torch.zeros(bsz, H, tgt, src)
    for b in range(bsz):
        real = [j for j in range(src) if not pad[b, j]]
        pos = {j: n for n, j in enumerate(real)}
        for i in range(tgt):
            visible = [j for j in real if j <= src - tgt + i] if causal else real
            length = len(visible)
            hidden = torch.tanh(g.w_p.weight @ q[b, i])
            for h in range(H):
                centre = length * torch.sigmoid(g.u_p.weight[h] @ hidden)
                if g.strategy == "fixed":
                    window = torch.tensor(g.fixed_window)
                elif g.strategy == "head":
                    window = g.max_window * torch.sigmoid(g.z[h])
                elif g.strategy == "query":
                    window = length * torch.sigmoid(g.u_d.weight[h] @ hidden)
                else:
                    mean_key = torch.stack([k[b, j] for j in visible]).mean(0)
                    window = length * torch.sigmoid(
                        g.u_d.weight[h] @ torch.tanh(g.w_d.weight @ mean_key)
                    )
                sigma = window / 2
                for j in real:
                    out[b, h, i, j] = -((pos[j] - centre) ** 2) / (2 * sigma**2)
    return out


@pytest.mark.parametrize("strategy", ["fixed", "layer", "query", "head"])
@pytest.mark.parametrize("causal", [False, True])
def test_bias_matches_the_formula_with_padding_and_varied_lengths(strategy, causal):
    g = module(strategy)
    with torch.no_grad():
        if g.z is not None:
            g.z.copy_(torch.tensor([-1.0, 0.0, 2.0]))
    q, k = torch.randn(3, 6, D), torch.randn(3, 6, D)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    if causal:
        pad[1, 4:] = True  # decoder targets are right-padded
    else:
        pad[1, :2] = True  # sources are left-padded
        pad[2, :5] = True  # a length-1 sentence
    bias, centre, window = g(q, k, pad, causal)
    expected = direct(g, q, k, pad, causal)
    real = ~pad[:, None, None, :].expand_as(bias)
    torch.testing.assert_close(bias[real], expected[real], atol=1e-4, rtol=1e-4)
    assert (centre >= 0).all() and torch.isfinite(bias).all()


def test_left_padding_gives_the_same_bias_as_no_padding():
    g = module("query")
    q, k = torch.randn(1, 4, D), torch.randn(1, 4, D)
    alone, _, _ = g(q, k, None, False)
    padded_q = torch.cat([torch.zeros(1, 2, D), q], 1)
    padded_k = torch.cat([torch.zeros(1, 2, D), k], 1)
    pad = torch.tensor([[True, True, False, False, False, False]])
    padded, _, _ = g(padded_q, padded_k, pad, False)
    torch.testing.assert_close(padded[:, :, 2:, 2:], alone)


def test_centre_and_window_lie_in_zero_to_length():
    g = module("query")
    _, centre, window = g(torch.randn(2, 7, D) * 10, torch.randn(2, 7, D), None, False)
    assert (centre >= 0).all() and (centre <= 7).all() and (window <= 7).all()


@pytest.mark.parametrize(
    "strategy,params",
    [
        ("query", ["w_p", "u_p", "u_d"]),
        ("layer", ["w_p", "u_p", "w_d", "u_d"]),
        ("head", ["w_p", "u_p", "z"]),
        ("fixed", ["w_p", "u_p"]),
    ],
)
def test_gradients_reach_every_parameter(strategy, params):
    g = module(strategy)
    bias, _, _ = g(torch.randn(2, 5, D), torch.randn(2, 5, D), None, False)
    bias.sum().backward()
    for name, p in g.named_parameters():
        assert name.split(".")[0] in params
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_collapsed_window_is_finite():
    g = module("query")
    with torch.no_grad():
        g.u_d.weight.fill_(-1e4)  # sigmoid underflows: D = 0 without the clamp
    bias, _, window = g(torch.randn(1, 3, D) + 1, torch.randn(1, 3, D), None, False)
    assert torch.isfinite(bias).all() and (window >= 0).all() and (bias <= 0).all()
