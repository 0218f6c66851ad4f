"""Sensitivity (Pande et al. Sec. 3.1): exact Jacobian norms, the gammas, the subcommand."""

import pytest
import torch

from local_attn_fairseq.analysis.loading import AttentionCall, attention_inputs
from local_attn_fairseq.analysis.sensitivity import gammas, jacobian_norms, set_average
from local_attn_fairseq.locality.spec import HeadSpec
from local_attn_fairseq.modules.local_multihead_attention import LocalMultiheadAttention

from .conftest import CONLLU, analyze, one_layer_model, read_json


def one_sentence(task, words):
    src_dict = task.source_dictionary
    tokens = src_dict.encode_line(" ".join(words), add_if_not_exist=False).long()[None]
    return {"net_input": {"src_tokens": tokens, "src_lengths": torch.tensor([tokens.size(1)])}}


@pytest.mark.parametrize("mask", ["local-2", "band-1", "global"])
def test_jacobian_norms_equal_the_full_jacobian(mask):
    torch.manual_seed(0)
    attention = LocalMultiheadAttention(
        16, 4, self_attention=True, head_specs=[HeadSpec(mask=mask)] * 4
    ).eval()
    x = torch.randn(7, 1, 16)
    # a small chunk forces several backward passes
    beta = jacobian_norms(attention, AttentionCall(x, None, None), chunk_elements=300)

    def attend(z):
        return attention(z[:, None], z[:, None], z[:, None], need_weights=False)[0][:, 0]

    jacobian = torch.autograd.functional.jacobian(attend, x[:, 0])  # (T, dim, T, dim)
    torch.testing.assert_close(beta, jacobian.pow(2).sum((1, 3)).sqrt(), atol=1e-5, rtol=1e-4)


def test_band_limited_heads_are_blind_beyond_two_tokens(tiny_data):
    """A one-layer encoder of local-2 heads (softmax inside the window): the outputs do not
    depend on inputs more than 2 tokens away, exactly."""
    model, task = one_layer_model(tiny_data, "local-2")
    sample = one_sentence(task, "Der Schüler schrieb an der Tafel und las ein Buch .".split())
    call = attention_inputs(model, sample)[("encoder_self", 0)]
    beta = jacobian_norms(model.encoder.layers[0].self_attn, call)
    distance = torch.arange(beta.size(0))
    far = (distance[:, None] - distance[None, :]).abs() > 2
    assert beta[far].abs().max() == 0
    assert (beta[~far] > 0).all()


def test_pande_band_masks_still_feel_far_tokens_through_the_softmax(tiny_data):
    """band-2 multiplies a softmax over ALL keys: far keys change its normaliser."""
    model, task = one_layer_model(tiny_data, "band-2")
    sample = one_sentence(task, "Der Schüler schrieb an der Tafel und las ein Buch .".split())
    call = attention_inputs(model, sample)[("encoder_self", 0)]
    beta = jacobian_norms(model.encoder.layers[0].self_attn, call)
    assert beta[0, 5:].min() > 0


def test_input_is_read_after_the_pre_layer_norm(tiny_data):
    model, task = one_layer_model(tiny_data, "global", "--encoder-normalize-before")
    sample = one_sentence(task, "Der Schüler schrieb .".split())
    call = attention_inputs(model, sample)[("encoder_self", 0)]
    embedded, _ = model.encoder.forward_embedding(sample["net_input"]["src_tokens"])
    expected = model.encoder.layers[0].self_attn_layer_norm(embedded.transpose(0, 1))
    torch.testing.assert_close(call.query, expected)


def test_gammas_average_rows_then_tokens():
    beta = torch.tensor([[1.0, 2.0, 4.0], [0.0, 3.0, 5.0], [7.0, 7.0, 7.0]])
    members = torch.tensor([[False, True, True], [False, False, False], [True, False, False]])
    assert set_average(beta, members) == pytest.approx((3.0 + 7.0) / 2)  # row 1 has no set
    assert gammas(beta, {"none": torch.zeros(3, 3, dtype=torch.bool)}) == {"none": None}


def test_subcommand_with_conllu_on_raw_text(trained_checkpoint, tiny_data, source_text, tmp_path):
    out = tmp_path / "out"
    proc = analyze(
        "sensitivity", "--path", trained_checkpoint, "--data", tiny_data / "bin",
        "--source-text", source_text, "--conllu", CONLLU, "--output-dir", out, "--cpu",
    )  # fmt: skip
    result = read_json(out / "sensitivity.json")
    assert result["sets"] == ["local", "syntactic", "unrelated"]
    assert (
        result["syntax"]["aligned_sentences"] == 2 and not result["syntax"]["unaligned_sentences"]
    )
    assert len(result["layers"]) == 6
    for layer in result["layers"]:
        assert len(layer["per_sentence"]["local"]) == 2
        assert all(v > 0 for v in layer["per_sentence"]["local"])
    assert (out / "sensitivity.png").stat().st_size > 1000
    assert "gamma_syntactic" in proc.stdout
