"""Layer-wise relevance propagation: the rules against brute force, conservation through real
models, gates, padding."""

import pytest
import torch

from local_attn_fairseq.analysis.lrp import (
    HeadRelevance,
    Rule,
    normalise_over_heads,
    propagate_relevance,
    relprop_attention,
    relprop_linear,
    relprop_sum,
)

from .helpers_heads import PAIRS, batch, small_model

RULES = [Rule("alpha-beta"), Rule("alpha-beta", alpha=0.8), Rule("ratio", eps=1e-9)]


def shares_by_brute_force(contributions, rule):
    """contributions (out, in) -> each input's share of each output's relevance (out, in)."""
    if rule.name == "ratio":
        return contributions / contributions.sum(-1, keepdim=True)
    pos, neg = contributions.clamp(min=0), contributions.clamp(max=0)
    pos_sum, neg_sum = pos.sum(-1, keepdim=True), neg.sum(-1, keepdim=True)
    alpha = torch.where(neg_sum < 0, rule.alpha, 1.0) * (pos_sum > 0)
    beta = torch.where(pos_sum > 0, 1 - alpha, 1.0) * (neg_sum < 0)
    return alpha * pos / pos_sum.clamp(min=1e-30) + beta * neg / neg_sum.clamp(max=-1e-30)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.name}-{r.alpha}")
def test_linear_rule_matches_brute_force_and_conserves(rule):
    torch.manual_seed(0)
    x, weight = torch.randn(5, 7, dtype=torch.float64), torch.randn(3, 7, dtype=torch.float64)
    relevance = torch.rand(2, 5, 3, dtype=torch.float64)  # (steps, tokens, out)
    result = relprop_linear(x, weight, relevance, rule)
    for token in range(5):
        shares = shares_by_brute_force(weight * x[token], rule)  # (out, in)
        torch.testing.assert_close(result[:, token], relevance[:, token] @ shares)
    torch.testing.assert_close(result.sum((1, 2)), relevance.sum((1, 2)))


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.name}-{r.alpha}")
def test_attention_rule_matches_brute_force(rule):
    torch.manual_seed(1)
    weights = torch.softmax(torch.randn(1, 2, 4, 6, dtype=torch.float64), -1)
    values = torch.randn(1, 2, 6, 3, dtype=torch.float64)
    relevance = torch.rand(3, 1, 2, 4, 3, dtype=torch.float64)
    result = relprop_attention(weights, values, relevance, rule)
    expected = torch.zeros_like(result)
    for head in range(2):
        for query in range(4):
            for dim in range(3):
                contributions = weights[0, head, query] * values[0, head, :, dim]  # (src,)
                shares = shares_by_brute_force(contributions[None], rule)[0]
                expected[:, 0, head, :, dim] += relevance[:, 0, head, query, dim, None] * shares
    torch.testing.assert_close(result, expected)
    torch.testing.assert_close(result.sum((1, 2, 3, 4)), relevance.sum((1, 2, 3, 4)))


def test_alpha_beta_gives_all_to_the_only_sign_and_nothing_without_contributions():
    rule = Rule("alpha-beta", alpha=0.5)
    residual, update = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([1.0, 0.0, -3.0])
    relevance = torch.ones(1, 3)
    to_residual, to_update = relprop_sum([residual, update], relevance, rule)
    # all positive: shares 2/3, 1/3; all zero: nothing; all negative: shares 1/4, 3/4
    torch.testing.assert_close(to_residual, torch.tensor([[2 / 3, 0.0, 0.25]]))
    torch.testing.assert_close(to_update, torch.tensor([[1 / 3, 0.0, 0.75]]))


def test_rule_options_are_checked():
    with pytest.raises(ValueError, match="unknown LRP rule 'z'"):
        Rule("z")
    with pytest.raises(ValueError, match=r"alpha must lie in \[0, 1\]"):
        Rule(alpha=1.5)


def assert_conserved(result, atol=1e-9):
    """Relevance 1 per real target step at the top; every layer passes on what it receives."""
    totals = result.layer_totals
    top = max(index for side, index in totals if side == "decoder")
    expected_top = result.steps_mask.to(torch.float64)
    torch.testing.assert_close(totals[("decoder", top)]["output"], expected_top)
    for (side, _), layer in totals.items():
        passed_on = layer["input"] + (layer["encoder"] if side == "decoder" else 0)
        torch.testing.assert_close(passed_on, layer["output"], atol=atol, rtol=0)


MODELS = {
    "plugin post-norm, fixed masks, local window, relative positions": (
        "transformer_local",
        "--locality-config",
        "{encoder_self: {all: [prev-1, local-1, band-2, global]}}",
        "--relative-positions", "4",
    ),
    "plugin pre-norm, tied Q/K, Gaussian heads": (
        "transformer_local",
        "--encoder-normalize-before", "--decoder-normalize-before",
        "--locality-config", "{encoder_self: {all: [identity, next-1@0, global, global@2]}}",
        "--localness-layers", "encoder_self:0",
    ),
    "plugin, pruned heads (layer 1 has none left)": (
        "transformer_local",
        "--locality-config", "{heads_kept: {encoder_self: [[0, 2], []]}}",
    ),
    "fairseq transformer": ("transformer",),
}  # fmt: skip


@pytest.mark.parametrize("name", list(MODELS))
def test_relevance_is_conserved_through_real_models(name, tmp_path):
    arch, *extra = MODELS[name]
    model, task = small_model(tmp_path, arch, *extra)
    sample = batch(task)
    result = propagate_relevance(model, sample)
    assert_conserved(result)
    pruned = "pruned" in name
    assert set(result.heads) == {
        (kind, layer) for kind in ("encoder_self", "decoder_self", "decoder_cross")
        for layer in (0, 1) if not (pruned and (kind, layer) == ("encoder_self", 1))
    }  # fmt: skip
    if pruned:
        assert result.kept_heads[("encoder_self", 0)] == [0, 2]
    for key, heads in result.heads.items():
        assert heads.shape == (result.steps_mask.size(0), len(PAIRS), len(result.kept_heads[key]))
        assert torch.isfinite(heads).all() and (heads >= 0).all()
    if arch == "transformer":  # the fused path is given back after the analysis
        assert not model.encoder.layers[0].self_attn.skip_embed_dim_check


def test_ratio_rule_is_conserved_up_to_its_stabiliser(tmp_path):
    model, task = small_model(tmp_path)
    result = propagate_relevance(model, batch(task), Rule("ratio", eps=1e-12))
    assert_conserved(result, atol=1e-5)


def test_closed_gate_head_has_no_relevance(tmp_path):
    model, task = small_model(tmp_path, "transformer_local", "--head-gates", "enc")
    with torch.no_grad():
        model.encoder.layers[1].self_attn.head_gates.log_alpha[2] = -20.0  # P(g = 0) ~ 1
    result = propagate_relevance(model, batch(task))
    assert_conserved(result)
    heads = result.heads[("encoder_self", 1)]
    assert (heads[..., 2] == 0).all()
    assert (heads[..., [0, 1, 3]].sum(-1)[result.steps_mask] > 0).all()


def test_padding_changes_nothing(tmp_path):
    """A sentence alone and inside a padded batch (left-padded source, right-padded target)
    gets the same head relevance."""
    model, task = small_model(tmp_path, "transformer_local")
    together = propagate_relevance(model, batch(task))
    alone = propagate_relevance(model, batch(task, PAIRS[2:]))
    steps = int(alone.steps_mask.sum())
    for key, heads in alone.heads.items():
        torch.testing.assert_close(together.heads[key][:steps, 2], heads[:steps, 0])


def test_head_relevance_is_normalised_per_step_and_averaged_over_real_steps(tmp_path):
    model, task = small_model(tmp_path)
    result = propagate_relevance(model, batch(task))
    accumulated = HeadRelevance(types=("encoder_self",))
    accumulated.add(result)
    means = accumulated.means()
    assert set(means) == {("encoder_self", 0), ("encoder_self", 1)}
    shares = normalise_over_heads(result.heads[("encoder_self", 0)].double())
    expected = shares[result.steps_mask].mean(0)
    torch.testing.assert_close(means[("encoder_self", 0)], expected)
    torch.testing.assert_close(
        means[("encoder_self", 0)].sum(), torch.tensor(1.0, dtype=torch.float64)
    )


def test_models_without_a_decoder_are_refused(tmp_path):
    model, task = small_model(tmp_path)
    with pytest.raises(ValueError, match="needs target sentences"):
        propagate_relevance(model, {"net_input": {"src_tokens": torch.ones(1, 2).long()}})
    with pytest.raises(ValueError, match="encoder-decoder Transformer"):
        propagate_relevance(model.encoder, batch(task))
