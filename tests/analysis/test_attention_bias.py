"""Attention bias (Pande et al. Eq. 8): known answers and the subcommand."""

import pytest
import torch

from local_attn_fairseq.analysis.attention_bias import BiasScores, fraction_above, sentence_bias
from local_attn_fairseq.analysis.dependencies import token_sets
from local_attn_fairseq.analysis.loading import attention_weights

from ..conftest import TINY_MODEL
from ..models.helpers import build_model
from .conftest import CONLLU, analyze, one_layer_model, read_json
from .test_sensitivity import one_sentence

WORDS = (
    "Der Schüler schrieb an der Tafel und der Lehrer las ein Buch , während die Kinder im "
    "Garten spielten und die Sonne schien ."
).split()


def test_uniform_attention_has_bias_one():
    weights = torch.full((2, 6, 6), 1 / 6)
    scores, defined = sentence_bias(weights, token_sets(6)["local"])
    torch.testing.assert_close(scores, torch.ones(2))
    assert defined.all()


def test_empty_sets_and_zero_rows_are_left_out():
    weights = torch.zeros(1, 3, 3)
    weights[0, 1, 0] = 0.5  # rows 0 and 2 attend nowhere
    members = torch.tensor([[False, True, True], [True, False, False], [False, False, False]])
    scores, defined = sentence_bias(weights, members)
    assert scores.tolist() == [pytest.approx(3.0)] and defined.tolist() == [True]
    scores, defined = sentence_bias(weights, torch.zeros(3, 3, dtype=torch.bool))
    assert defined.tolist() == [False] and torch.isfinite(scores).all()


def test_prev_one_head_has_a_large_locality_bias(tiny_data):
    """A prev-1 head puts all its (masked) weight on i-1, inside L_i: Eq. 8 gives T / |L_i|."""
    model, task = one_layer_model(tiny_data, "prev-1")
    sample = one_sentence(task, WORDS)
    weights = attention_weights(model, sample)[("encoder_self", 0)]
    length = len(WORDS)  # </s> left out, as the subcommand does
    weights = weights[:, :length, :length]
    scores, defined = sentence_bias(weights, token_sets(length)["local"])
    # row 0 has no i-1; |L_i| is 4 at i = 1 and i = T-2, 3 at i = T-1, 5 elsewhere
    expected = (2 * length / 4 + length / 3 + (length - 4) * length / 5) / (length - 1)
    torch.testing.assert_close(scores, torch.full((8,), expected))
    assert expected > 3


def test_scores_average_sentences_and_count_heads_above_thresholds():
    accumulated = BiasScores()
    accumulated.add(0, "local", torch.tensor([2.0, 4.0]), torch.tensor([True, True]))
    accumulated.add(0, "local", torch.tensor([4.0, 9.0]), torch.tensor([True, False]))
    assert accumulated.scores(0, "local") == [3.0, 4.0]
    assert fraction_above([3.0, 4.0, None], 3) == 0.5


def test_subcommand_on_binarised_data(trained_checkpoint, tiny_data, tmp_path):
    out = tmp_path / "out"
    proc = analyze(
        "bias", "--path", trained_checkpoint, "--data", tiny_data / "bin",
        "--gen-subset", "valid", "--max-sentences", 4, "--output-dir", out, "--cpu",
    )  # fmt: skip
    result = read_json(out / "bias.json")
    assert result["sets"] == ["local"] and "only the locality bias" in result["note"]
    assert len(result["layers"]) == 6 and all(len(e["local"]) == 8 for e in result["layers"])
    # every head of transformer_local_tied is masked inside |i - j| <= 2
    assert result["fraction_above"]["local"]["1"] == 1.0
    for name in ("bias_thresholds.png", "bias_heads.png"):
        assert (out / name).stat().st_size > 1000
    assert "fraction of heads" in proc.stdout


def test_subcommand_with_syntax_in_process(trained_checkpoint, tiny_data, source_text, tmp_path):
    from local_attn_fairseq.analysis.cli import main

    out = tmp_path / "out"
    main(
        ["bias", "--path", str(trained_checkpoint), "--data", str(tiny_data / "bin"),
         "--source-text", str(source_text), "--conllu", str(CONLLU), "--output-dir", str(out),
         "--cpu"]
    )  # fmt: skip
    result = read_json(out / "bias.json")
    assert result["sets"] == ["local", "syntactic"]
    assert set(result["heads_above_map_threshold"]) == {"local", "syntactic"}


def test_plain_fairseq_transformer_gives_per_head_weights(tiny_data):
    """fairseq's own MultiheadAttention (``--arch transformer``) is read head by head too."""
    model, task, _ = build_model(tiny_data / "bin", "transformer", *TINY_MODEL)
    model.eval()
    sample = one_sentence(task, WORDS[:6])
    prev = sample["net_input"]["src_tokens"][:, :4]
    sample["net_input"]["prev_output_tokens"] = prev
    weights = attention_weights(model, sample)
    assert weights[("encoder_self", 5)].shape == (8, 7, 7)
    assert weights[("decoder_self", 1)].shape == (8, 4, 4)
    assert weights[("decoder_cross", 0)].shape == (8, 4, 7)
    torch.testing.assert_close(weights[("encoder_self", 0)].sum(-1), torch.ones(8, 7))
    assert not torch.allclose(weights[("encoder_self", 0)][0], weights[("encoder_self", 0)][1])
