import pytest

from .helpers import build_model, encoder_attention_weights

# Encoder attention weights of Transformer base (512 dims, 8 heads, 6 layers), Pande et al.
# Tables 1-3; the paper prints them truncated to two decimals of a million.
PAPER_COUNTS = {
    None: (6_291_456, "6.29M"),
    "2loc-all6": (6_291_456, "6.29M"),
    "4loc-all6": (6_291_456, "6.29M"),
    "8loc-first3": (6_291_456, "6.29M"),
    "8loc-last3": (6_291_456, "6.29M"),
    "8loc-all6": (6_291_456, "6.29M"),
    "4loc4tied-all6": (4_718_592, "4.71M"),
    "2loc6tied-all6": (3_932_160, "3.93M"),
    "1loc7tied-all6": (3_538_944, "3.53M"),
    "1loc7tied-first3": (4_915_200, "4.91M"),
    "half-tied": (4_784_128, "4.78M"),
    "fully-tied": (3_211_264, "3.21M"),
}


@pytest.mark.parametrize("preset", list(PAPER_COUNTS))
def test_encoder_attention_parameters_match_the_paper(tiny_data, preset):
    extra = ["--locality-config", preset] if preset else []
    model, _, _ = build_model(tiny_data / "bin", "transformer_local", *extra)
    exact, printed = PAPER_COUNTS[preset]
    count = encoder_attention_weights(model)
    assert count == exact
    assert f"{int(count / 1e4) / 100:.2f}M" == printed


def test_transformer_local_tied_is_config_i(tiny_data):
    model, _, args = build_model(tiny_data / "bin", "transformer_local_tied")
    assert encoder_attention_weights(model) == PAPER_COUNTS["1loc7tied-all6"][0]
    assert '"name": "1loc7tied-all6"' in args.locality_config


def test_plain_transformer_local_has_fairseq_transformer_parameter_count(tiny_data):
    ours, _, _ = build_model(tiny_data / "bin", "transformer_local")
    theirs, _, _ = build_model(tiny_data / "bin", "transformer")
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
