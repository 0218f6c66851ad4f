import pytest
import torch

from local_attn_fairseq.locality.gaussian import GaussianLocalness

D, H = 12, 3


def module(strategy, centre="paper"):
    torch.manual_seed(0)
    return GaussianLocalness(D, D, H, strategy, fixed_window=4.0, max_window=20.0, centre=centre)


def direct(g, q, k, pad, causal):
    """G written out entry by entry from Yang et al. Eqs. 5-11 (centre "paper"), or with their
    released code's P = (I - 1) sigmoid(p) and D = I sigmoid(z) + 0.1 (centre "code")."""
    code = g.centre == "code"
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
                centre = (length - code) * torch.sigmoid(g.u_p.weight[h] @ hidden)
                if g.strategy == "fixed":
                    window = torch.tensor(g.fixed_window)
                elif g.strategy == "head":
                    window = g.max_window * torch.sigmoid(g.z[h])
                elif g.strategy == "query":
                    window = length * torch.sigmoid(g.u_d.weight[h] @ hidden) + 0.1 * code
                else:
                    mean_key = torch.stack([k[b, j] for j in visible]).mean(0)
                    window = length * torch.sigmoid(
                        g.u_d.weight[h] @ torch.tanh(g.w_d.weight @ mean_key)
                    ) + 0.1 * code
                sigma = window / 2
                for j in real:
                    out[b, h, i, j] = -((pos[j] - centre) ** 2) / (2 * sigma**2)
    return out


@pytest.mark.parametrize("centre", ["paper", "code"])
@pytest.mark.parametrize("strategy", ["fixed", "layer", "query", "head"])
@pytest.mark.parametrize("causal", [False, True])
def test_bias_matches_the_formula_with_padding_and_varied_lengths(strategy, causal, centre):
    g = module(strategy, centre)
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


def saturated(strategy, centre, sign):
    """A module whose centre and window sigmoids saturate at 1 (sign +1) or 0 (sign -1)."""
    g = module(strategy, centre)
    with torch.no_grad():
        g.w_p.weight.copy_(torch.eye(D))
        g.u_p.weight.fill_(sign * 50.0)
        if g.u_d is not None:
            g.u_d.weight.fill_(sign * 50.0)
        if g.w_d is not None:
            g.w_d.weight.copy_(torch.eye(D))
    return g


@pytest.mark.parametrize("strategy", ["fixed", "layer", "query", "head"])
@pytest.mark.parametrize("causal", [False, True])
def test_code_centre_never_passes_the_last_real_key(strategy, causal):
    """Under Yang et al.'s code convention P = (I - 1) sigmoid(p) <= I - 1, the position of the
    last real key, whatever the padding and lengths; under Eqs. 6-9 P reaches I, one past it."""
    lengths = [7, 5, 1, 3]
    src = max(lengths)
    pad = torch.zeros(len(lengths), src, dtype=torch.bool)
    for b, n in enumerate(lengths):
        if causal:
            pad[b, n:] = True  # decoder targets are right-padded
        else:
            pad[b, : src - n] = True  # sources are left-padded
    q = torch.rand(len(lengths), src, D) + 0.5  # tanh(W_p q) > 0: p = 50 sum(...) saturates
    k = torch.rand(len(lengths), src, D) + 0.5  # the layer strategy's window saturates too
    if causal:
        seen = torch.arange(1, src + 1).clamp(max=torch.tensor(lengths)[:, None])
    else:
        seen = torch.tensor(lengths)[:, None].expand(-1, src)
    last_key = (seen - 1).float()[:, None, :].expand(-1, H, -1)
    real_queries = ~pad[:, None, :].expand(-1, H, -1)
    _, centre, window = saturated(strategy, "code", +1)(q, k, pad, causal)
    assert (centre[real_queries] <= last_key[real_queries] + 1e-5).all()
    torch.testing.assert_close(centre[real_queries], last_key[real_queries])  # it reaches it
    _, paper_centre, _ = saturated(strategy, "paper", +1)(q, k, pad, causal)
    torch.testing.assert_close(paper_centre[real_queries], last_key[real_queries] + 1)
    if strategy in ("layer", "query"):  # a collapsed window is 0.1 wide, not 1e-4
        _, _, narrow = saturated(strategy, "code", -1)(q, k, pad, causal)
        torch.testing.assert_close(narrow, torch.full_like(narrow, 0.1))


def test_unknown_centre_convention_is_rejected():
    with pytest.raises(ValueError, match="unknown localness centre convention 'middle'"):
        GaussianLocalness(D, D, H, "query", centre="middle")
