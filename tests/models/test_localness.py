"""Gaussian localness and relative positions through fairseq's CLI and model API."""

import json

import pytest
from fairseq import checkpoint_utils

from local_attn_fairseq.analysis.localness import localness_windows
from local_attn_fairseq.modules.local_multihead_attention import LocalMultiheadAttention
from local_attn_fairseq.ops import mechanisms

from .helpers import assert_incremental_decoding_matches_full_forward, build_model
from ..conftest import TINY_MODEL, train_tiny
from .test_fairseq_cli import generate

CASES = {
    "fixed": ["--localness-window", "fixed"],
    "layer": ["--localness-window", "layer"],
    "query": ["--localness-window", "query"],
    "head": ["--localness-window", "head"],
    "decoder_self": ["--localness-layers", "decoder_self:all"],
    "decoder_cross": ["--localness-layers", "decoder_cross:0"],
    "with_rel_pos": ["--relative-positions", 4, "--relative-positions-values"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_train_generate_and_read_back(tiny_data, tmp_path, case):
    train_tiny(tiny_data, tmp_path, *CASES[case], arch="transformer_localness")
    checkpoint = tmp_path / "checkpoint_last.pt"
    generate(tiny_data, checkpoint)
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([str(checkpoint)])
    task.load_dataset("test")
    sample = task.dataset("test").collater([task.dataset("test")[i] for i in range(4)])
    windows = localness_windows(models[0], sample)
    assert windows, "no Gaussian heads found"
    for (attn_type, layer), found in windows.items():
        lengths = (sample["net_input"]["src_tokens"] != task.source_dictionary.pad()).sum(1)
        if attn_type == "encoder_self":
            assert found["centre"].shape == (4, 8, sample["net_input"]["src_tokens"].size(1))
            assert (found["centre"] <= lengths[:, None, None]).all()
        assert (found["centre"] >= 0).all() and (found["window"] > 0).all()


def test_default_is_query_specific_in_encoder_layers_0_to_2(tiny_data):
    model, _, _ = build_model(tiny_data / "bin", "transformer_localness", *TINY_MODEL)
    with_gauss = [
        i for i, layer in enumerate(model.encoder.layers) if layer.self_attn.localness is not None
    ]
    assert with_gauss == [0, 1, 2]
    assert model.encoder.layers[0].self_attn.localness.strategy == "query"
    assert all(layer.self_attn.localness is None for layer in model.decoder.layers)


def test_gaussian_layers_train_alike_through_sdpa(tiny_data, tmp_path, monkeypatch):
    """LOCAL_ATTN_MECHANISM_IMPL=sdpa (each Gaussian layer's bias handed to
    scaled_dot_product_attention as its mask) trains the model the explicit route trains: the
    losses and gradient norms fairseq-train logs, to their three decimals."""
    taken = []
    route = LocalMultiheadAttention._gaussian_sdpa_attention

    def counted(self, *args):
        taken.append(self.layer_index)
        return route(self, *args)

    monkeypatch.setattr(LocalMultiheadAttention, "_gaussian_sdpa_attention", counted)
    logs = {}
    for impl in ("torch", "sdpa"):
        monkeypatch.setenv(mechanisms.IMPL_ENV, impl)
        run = train_tiny(
            tiny_data, tmp_path / impl, "--log-format", "json", arch="transformer_localness"
        )
        logs[impl] = [
            json.loads(line.split(" | ")[-1])
            for line in run.stdout.splitlines()
            if " | train_inner | " in line
        ]
        # the explicit route never, the one-call route in encoder layers 0-2 of every pass
        assert sorted(set(taken)) == ([] if impl == "torch" else [0, 1, 2])
    assert len(logs["sdpa"]) == len(logs["torch"]) == 2
    for ours, ref in zip(logs["sdpa"], logs["torch"]):
        for key in ("loss", "gnorm"):
            assert float(ours[key]) == pytest.approx(float(ref[key]), abs=1e-3), key


def test_parameter_growth_matches_the_paper(tiny_data):
    """Transformer base, query-specific, encoder layers 1-3: 88.0M -> 88.8M (Table 4)."""
    base, _, _ = build_model(tiny_data / "bin", "transformer_local")
    local, _, _ = build_model(tiny_data / "bin", "transformer_localness")
    grown = sum(p.numel() for p in local.parameters()) - sum(p.numel() for p in base.parameters())
    assert grown == 3 * (512 * 512 + 2 * 512 * 8) == 811_008


def test_decoder_side_incremental_decoding_equals_full_forward(tiny_data):
    model, task, _ = build_model(
        tiny_data / "bin",
        "transformer_localness",
        *TINY_MODEL,
        "--localness-window",
        "layer",
        "--localness-layers",
        "encoder_self:0-2 decoder_self:all decoder_cross:all",
        "--relative-positions",
        3,
        "--relative-positions-values",
    )
    assert_incremental_decoding_matches_full_forward(model, task)


@pytest.mark.parametrize(
    "options,message",
    [
        (["--localness-layers", "encoder_self:7"], "layer 7 does not exist"),
        (["--localness-layers", "encoder:0"], "unknown attention type 'encoder'"),
        (["--localness-layers", "encoder_self"], "is not ATTENTION_TYPE:LAYERS"),
        (["--localness-max-window", "-3"], "max_window must be a positive number"),
        (["--relative-positions", "0"], "max_distance must be an integer >= 1"),
        (
            ["--relative-positions", "4", "--relative-positions-attention", "decoder_cross"],
            "not a self-attention type",
        ),
    ],
)
def test_wrong_localness_options_are_rejected(tiny_data, options, message):
    with pytest.raises(ValueError, match=message):
        build_model(tiny_data / "bin", "transformer_localness", *TINY_MODEL, *options)
