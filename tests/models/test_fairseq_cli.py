"""The plugin through fairseq's own command-line tools: train, checkpoint, generate, interact."""

import json

import pytest
import torch
from fairseq import checkpoint_utils

from ..conftest import TINY_MODEL, TRAIN, USER_DIR, fairseq_cli, train_tiny
from .helpers import assert_incremental_decoding_matches_full_forward, build_model, generate
from .test_parameter_counts import PAPER_COUNTS

DECODER_LOCAL = (
    "{decoder_self: {all: [band-1, prev-1, prev-2, identity, global, global, global, global]},"
    " decoder_cross: {all: [global, global@0, global@0, global@0, global, global, global, global]}}"
)


@pytest.mark.parametrize("preset", [p for p in PAPER_COUNTS if p] + [DECODER_LOCAL])
def test_train_checkpoint_generate(tiny_data, tmp_path, preset):
    train_tiny(tiny_data, tmp_path, "--locality-config", preset)
    generate(tiny_data, tmp_path / "checkpoint_last.pt")


def test_checkpoint_describes_itself(tiny_data, tmp_path):
    spec_file = tmp_path / "my_layout.yaml"
    spec_file.write_text(
        "name: mine\nencoder_self:\n  0-2: [band-2, next-1, identity@0, global, global, global, global, global]\n"
    )
    train_tiny(tiny_data, tmp_path / "ckpt", "--locality-config", spec_file)
    spec_file.unlink()  # generation must not need the file any more
    state = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "ckpt" / "checkpoint_last.pt"))
    stored = json.loads(state["cfg"]["model"].locality_config)
    assert stored["name"] == "mine" and "0-2" in stored["encoder_self"]
    generate(tiny_data, tmp_path / "ckpt" / "checkpoint_last.pt")


def test_interactive_and_resume(tiny_data, tmp_path):
    train_tiny(tiny_data, tmp_path, arch="transformer_local_tied", max_update=2)
    proc = fairseq_cli(
        "fairseq-interactive",
        tiny_data / "bin",
        "--user-dir",
        USER_DIR,
        "--path",
        tmp_path / "checkpoint_last.pt",
        "--source-lang",
        "de",
        "--target-lang",
        "en",
        "--beam",
        2,
        "--max-len-b",
        5,
        stdin="Das ist ein Haus .\nEr kommt heute .\n",
    )
    assert sum(line.startswith("H-") for line in proc.stdout.splitlines()) == 2

    resumed = train_tiny(tiny_data, tmp_path, arch="transformer_local_tied", max_update=4)
    log = resumed.stdout + resumed.stderr
    assert "Loaded checkpoint" in log and "@ 2 updates" in log
    assert "num_updates 4" in log or "num_updates=4" in log


def test_load_pretrained_encoder(tiny_data, tmp_path):
    train_tiny(tiny_data, tmp_path, "--locality-config", "half-tied")
    source = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "checkpoint_last.pt"))["model"]
    model, _, args = build_model(
        tiny_data / "bin",
        "transformer_local",
        *TINY_MODEL,
        "--locality-config",
        "half-tied",
        "--load-pretrained-encoder-from",
        tmp_path / "checkpoint_last.pt",
    )
    for name, value in model.encoder.state_dict().items():
        torch.testing.assert_close(value, source["encoder." + name])
    assert args.load_pretrained_encoder_from is None


@pytest.mark.parametrize(
    "spec,message",
    [
        (
            "{encoder_self: {all: [bnd-2, global, global, global, global, global, global, global]}}",
            "unknown mask 'bnd-2'",
        ),
        (
            "{encoder_self: {all: [global, global, global, global]}}",
            "lists 4 heads but the model has 8",
        ),
        (
            "{encoder_self: {0: [band-1@12, global, global, global, global, global, global, global]}}",
            "ties to head 12, which does not exist",
        ),
        (
            "{encoder_self: {0: [band--1, global, global, global, global, global, global, global]}}",
            "negative window",
        ),
    ],
)
def test_wrong_spec_is_rejected_before_training(tiny_data, tmp_path, spec, message):
    proc = fairseq_cli(
        "fairseq-train",
        tiny_data / "bin",
        "--user-dir",
        USER_DIR,
        "--arch",
        "transformer_local",
        *TINY_MODEL,
        *TRAIN,
        "--max-update",
        2,
        "--save-dir",
        tmp_path / "ckpt",
        "--locality-config",
        spec,
        check=False,
    )
    assert proc.returncode != 0
    assert "--locality-config" in proc.stderr and message in proc.stderr
    assert "begin training" not in proc.stdout + proc.stderr
    assert not (tmp_path / "ckpt" / "checkpoint_last.pt").exists()


LOCAL_HEADS = (
    "{encoder_self: {all: [local-1, local-1, local-2, local-2, local-4, local-4, local-8, local-8]},"
    " decoder_self: {all: [local-3-0, local-3-0, local-3-0, local-3-0, global, global, global, global]}}"
)


def test_local_heads_train_and_generate(tiny_data, tmp_path):
    train_tiny(tiny_data, tmp_path, "--locality-config", LOCAL_HEADS)
    generate(tiny_data, tmp_path / "checkpoint_last.pt")
    model, task, _ = build_model(tiny_data / "bin", "transformer_local", "--locality-config",
                                 LOCAL_HEADS, *TINY_MODEL)  # fmt: skip
    assert model.encoder.layers[0].self_attn.all_heads_local
    assert_incremental_decoding_matches_full_forward(model, task)


CROSS_LOCAL = (
    "{decoder_cross: {0: [local-2, local-2, local-2, local-2, global, global, global, global]}}"
)


@pytest.mark.parametrize(
    "arch,options,message",
    [
        ("transformer_local", ["--head-gates", "enc,cross"],
         "head_gates: this model has no decoder_cross attention"),
        ("transformer_local", ["--locality-config", CROSS_LOCAL],
         "this model has no decoder_cross attention"),
        ("transformer_local", ["--localness-layers", "decoder_cross:0"],
         "localness: this model has no decoder_cross attention"),
        ("transformer_dynwin", ["--dynamic-window", "decoder_cross:aw:0"],
         "dynamic_window layers decoder_cross: not an attention type of this model"),
    ],
)  # fmt: skip
def test_cross_attention_settings_are_refused_without_cross_attention(
    tiny_data, arch, options, message
):
    """--no-cross-attention builds decoders without cross-attention: settings for it would be
    unused, so they are refused, naming the option."""
    with pytest.raises(ValueError, match=r"without cross-attention \(--no-cross-attention\)") as e:
        build_model(tiny_data / "bin", arch, *TINY_MODEL, "--no-cross-attention", *options)
    assert message in str(e.value)


def test_dynwin_without_cross_attention_keeps_its_self_attention_windows(tiny_data, tmp_path):
    """transformer_dynwin with --no-cross-attention is Enc(AW) - Dec(MW): it trains and
    generates, and its checkpoint names no cross-attention windows."""
    train_tiny(tiny_data, tmp_path, "--no-cross-attention", arch="transformer_dynwin")
    generate(tiny_data, tmp_path / "checkpoint_last.pt")
    state = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "checkpoint_last.pt"))
    assert state["cfg"]["model"].dynamic_window == "encoder_self:aw:0-2 decoder_self:mw:0-1"
    windowed = {k.split(".dynamic_windows.")[0] for k in state["model"] if ".dynamic_windows." in k}
    assert windowed == {
        *(f"encoder.layers.{i}.self_attn" for i in range(3)),
        *(f"decoder.layers.{i}.self_attn" for i in range(2)),
    }
    assert not any("encoder_attn" in k for k in state["model"])


# Options of fairseq's attention layer and decoder stack that the plugin's models cannot honour.
FOREIGN_ATTENTION_OPTIONS = [
    (["--quant-noise-pq", "0.1"], "--quant-noise-pq: quantization noise is not supported"),
    (["--encoder-xformers-att-config", '{"name": "scaled_dot_product"}'],
     "--encoder-xformers-att-config: the plugin's attention layers compute attention themselves"),
    (["--decoder-xformers-att-config", '{"name": "scaled_dot_product"}'],
     "--decoder-xformers-att-config: the plugin's attention layers compute attention themselves"),
    (["--base-layers", "1"], "--base-layers: BASE layers are not supported in the plugin's decoders"),
]  # fmt: skip


@pytest.mark.parametrize("arch", ["transformer_local_tied", "transformer_localness", "transformer_dynwin"])
@pytest.mark.parametrize("options,message", FOREIGN_ATTENTION_OPTIONS)
def test_foreign_attention_options_are_refused(tiny_data, tmp_path, arch, options, message):
    """Quantization noise and xFormers' attention would be silently skipped by the plugin's
    attention, BASE layers would renumber the layers its spec refers to: fairseq-train stops
    before training, naming the option."""
    proc = fairseq_cli(
        "fairseq-train", tiny_data / "bin", "--user-dir", USER_DIR, "--arch", arch, *TINY_MODEL,
        *TRAIN, "--max-update", 2, "--save-dir", tmp_path / "ckpt", *options, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "begin training" not in proc.stdout + proc.stderr
    assert not (tmp_path / "ckpt" / "checkpoint_last.pt").exists()


def test_quant_noise_trains_fairseqs_own_transformer(tiny_data, tmp_path):
    """The control: the option works with fairseq's transformer, so the refusal is the plugin's."""
    train_tiny(tiny_data, tmp_path, "--quant-noise-pq", "0.1", arch="transformer")
    assert (tmp_path / "checkpoint_last.pt").exists()


def test_cross_self_attention_trains_and_decodes_with_local_encoders(tiny_data, tmp_path):
    """--cross-self-attention (the decoder's self-attention also attends to the source) with a
    local encoder and gated decoder heads: trains, generates, and decodes step by step as the
    full pass does."""
    options = ["--cross-self-attention", "--head-gates", "dec"]
    train_tiny(tiny_data, tmp_path, *options, arch="transformer_local_tied")
    generate(tiny_data, tmp_path / "checkpoint_last.pt")
    model, task, _ = build_model(
        tiny_data / "bin", "transformer_local_tied", *TINY_MODEL, *options
    )
    assert_incremental_decoding_matches_full_forward(model, task)


@pytest.mark.parametrize(
    "arch,options",
    [
        ("transformer_dynwin", []),
        ("transformer_local", ["--localness-layers", "decoder_self:0"]),
        ("transformer_local", ["--locality-config", DECODER_LOCAL]),
    ],
)
def test_cross_self_attention_is_refused_with_positional_decoder_heads(tiny_data, arch, options):
    """Prepending the source to the decoder's keys would shift the positions that windows,
    localness and head masks of decoder self-attention are defined on."""
    with pytest.raises(ValueError, match="--cross-self-attention prepends the source"):
        build_model(tiny_data / "bin", arch, *TINY_MODEL, "--cross-self-attention", *options)
