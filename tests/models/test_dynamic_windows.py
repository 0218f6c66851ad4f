"""transformer_dynwin through fairseq's CLI: every module x method x masking trains and generates."""

import pytest
import torch

from local_attn_fairseq.locality.spec import LocalitySpec, LocalitySpecError

from ..conftest import train_tiny
from .helpers import assert_incremental_decoding_matches_full_forward, build_model, generate

# Every (attention type, method, masking) combination appears once across these layouts.
LAYOUTS = [
    "encoder_self:mw:0 decoder_cross:aw-seg:0-1 decoder_self:aw:1",
    "encoder_self:aw:0-2 decoder_cross:mw-seg:1 decoder_self:mw:0",
    "encoder_self:mw-seg:5 decoder_cross:mw:all decoder_self:mw:all",
    "encoder_self:aw-seg:1 decoder_cross:aw:0 decoder_self:aw:0",
]
LAYERS = {"encoder_self": 6, "decoder_self": 2, "decoder_cross": 2}
HEADS = {"encoder_self": 8, "decoder_self": 8, "decoder_cross": 8}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_combination_trains_and_generates(tiny_data, tmp_path, layout):
    train_tiny(tiny_data, tmp_path, "--dynamic-window", layout, "--dynamic-window-segment-size", 3,
               arch="transformer_dynwin")  # fmt: skip
    generate(tiny_data, tmp_path / "checkpoint_last.pt")


def test_default_is_the_papers_best_model_and_decodes_incrementally(tiny_data):
    model, task, args = build_model(tiny_data / "bin", "transformer_dynwin_tiny")
    enc, dec = model.encoder.layers, model.decoder.layers
    assert [bool(layer.self_attn.dynamic_windows) for layer in enc] == [True] * 3 + [False] * 3
    assert enc[0].self_attn.local_q_proj is not None  # Enc(AW)
    assert enc[0].self_attn.dynamic_windows[0].segment_size is None
    assert dec[0].encoder_attn.dynamic_windows[0].segment_size == 5  # Cr(AW, Seg)
    assert dec[0].encoder_attn.local_q_proj is not None
    assert dec[0].self_attn.local_q_proj is None and dec[0].self_attn.dynamic_windows  # Dec(MW)
    assert_incremental_decoding_matches_full_forward(model, task)


def test_spec_syntax_and_validation():
    spec = LocalitySpec(
        {"encoder_self": {0: ["aw-seg3", "band-2+mw", "gaussian+aw", "global"] + ["global"] * 4},
         "dynamic_window": {"layers": {"decoder_cross": "aw-seg:1"}, "segment_size": 4}},
        LAYERS, HEADS,
    )  # fmt: skip
    heads = spec.heads("encoder_self", 0)
    assert [h.token for h in heads[:3]] == ["aw-seg3", "band-2+mw", "gaussian+aw"]
    assert {(h.window, h.segment) for h in spec.heads("decoder_cross", 1)} == {("aw", 4)}
    with pytest.raises(LocalitySpecError, match="segment-based windows"):
        LocalitySpec({"dynamic_window": {"layers": {"decoder_self": "mw-seg:0"}}}, LAYERS, HEADS)
    with pytest.raises(LocalitySpecError, match="METHOD:LAYERS"):
        LocalitySpec({"dynamic_window": {"layers": {"encoder_self": "xw:0"}}}, LAYERS, HEADS)
    with pytest.raises(LocalitySpecError, match="segment size"):
        LocalitySpec({"encoder_self": {0: ["aw-segx"] + ["global"] * 7}}, LAYERS, HEADS)
    with pytest.raises(LocalitySpecError, match="more than one dynamic window"):
        LocalitySpec({"encoder_self": {0: ["aw+mw"] + ["global"] * 7}}, LAYERS, HEADS)
    with pytest.raises(LocalitySpecError, match="segment_size"):
        LocalitySpec({"dynamic_window": {"segment_size": 0}}, LAYERS, HEADS)


def test_window_parameters_are_in_the_state_dict(tiny_data):
    model, _, _ = build_model(tiny_data / "bin", "transformer_dynwin_tiny")
    names = set(model.state_dict())
    assert "encoder.layers.0.self_attn.dynamic_windows.0.query_pointers.weight" in names
    assert "decoder.layers.2.self_attn.dynamic_windows.0.query_pointers.weight" in names
    assert "encoder.layers.0.self_attn.local_k_proj.weight" in names
    assert torch.isfinite(model.encoder.layers[0].self_attn.local_k_proj.weight).all()
