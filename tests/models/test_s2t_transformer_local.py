"""s2t_transformer_local: windowed encoder self-attention in fairseq's S2T Transformer."""

import pytest
import torch
from fairseq import checkpoint_utils, options, tasks

from ..conftest import fairseq_cli
from ..speech_data import (
    USER_DIR,
    asr_checkpoint,
    build_s2t,
    padded_fbank,
    train_s2t,
    write_speech_data,
)
from local_attn_fairseq.models.s2t_transformer_local import (
    PAPER_WINDOWS,
    S2TTransformerLocalModel,
    parse_windows,
    s2t_transformer_local,
    s2t_transformer_local_tiny,
)

SMALLER = dict(encoder_embed_dim=32, encoder_ffn_embed_dim=64, conv_channels=32)


def tiny(form="banded", **options):
    torch.manual_seed(0)
    options = {**SMALLER, **options}
    return build_s2t(
        S2TTransformerLocalModel, s2t_transformer_local_tiny, local_attention_form=form, **options
    )


def banded_and_masked(**options):
    banded, masked = tiny("banded", **options), tiny("masked", **options)
    masked.load_state_dict(banded.state_dict())
    return banded, masked


def encode(model, features, lengths):
    out = model.encoder(features, lengths)
    return out["encoder_out"][0], lengths_after_conv(model, lengths)


def lengths_after_conv(model, lengths):
    return model.encoder.subsample.get_out_seq_lens_tensor(lengths)


def test_tiny_arch_has_the_documented_shape_and_windows():
    model = build_s2t(S2TTransformerLocalModel, s2t_transformer_local_tiny)
    layers = model.encoder.transformer_layers
    assert layers[0].embed_dim == 64 and layers[0].fc1.out_features == 256
    assert model.encoder.attention_windows == [0, 0, 3, 5, 5, 7]
    assert len(layers) == 6 and len(model.decoder.layers) == 2
    assert layers[0].self_attn.has_local_heads is False
    assert [h.mask for h in layers[5].self_attn.head_specs] == ["local-3"] * 4
    assert layers[2].self_attn.num_heads == 4 and layers[2].normalize_before


def test_small_arch_is_s2t_transformer_s_with_the_papers_windows():
    model = build_s2t(S2TTransformerLocalModel, s2t_transformer_local)
    enc = model.encoder
    assert enc.attention_windows == parse_windows(PAPER_WINDOWS, 12)
    assert len(enc.transformer_layers) == 12 and len(model.decoder.layers) == 6
    assert enc.transformer_layers[0].embed_dim == 256
    assert enc.transformer_layers[0].self_attn.num_heads == 4
    assert enc.transformer_layers[11].fc1.out_features == 2048
    assert len(enc.subsample.conv_layers) == 2


def test_banded_and_masked_forms_give_the_same_outputs_and_gradients():
    banded, masked = banded_and_masked()
    features, lengths = padded_fbank([60, 25, 9])
    # float64 (the masked form's softmax stays float32): at random initialisation the
    # attention is near uniform and float32 gradients of Wq cancel to a few percent.
    features = features.double()
    outputs, grads = [], []
    for model in (banded.double(), masked.double()):
        model.train()  # dropout is 0: the training path without randomness
        out, out_lengths = encode(model, features, lengths)
        real = torch.arange(out.shape[0])[:, None] < out_lengths[None, :]
        (out * real[..., None]).pow(2).sum().backward()
        outputs.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in model.encoder.named_parameters()})
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-6, rtol=1e-6)
    assert grads[0].keys() == grads[1].keys()
    scale = max(grad.abs().max().item() for grad in grads[0].values())
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], atol=1e-6 * scale, rtol=1e-5)


def test_the_banded_form_builds_no_square_matrix_in_local_layers(monkeypatch):
    from local_attn_fairseq.modules import local_multihead_attention as lmha

    banded, masked = banded_and_masked()
    calls = []
    original = lmha.offset_mask
    monkeypatch.setattr(lmha, "offset_mask", lambda *a, **k: calls.append(1) or original(*a, **k))
    features, lengths = padded_fbank([60, 30])
    with torch.no_grad():
        encode(banded, features, lengths)
        assert calls == []  # local layers went through the banded operator
        encode(masked, features, lengths)
        assert len(calls) == 4  # the four windowed layers masked their T x T logits


@pytest.mark.parametrize("form", ["banded", "masked"])
def test_padding_and_very_short_inputs_stay_finite(form):
    model = tiny(form)
    model.train()
    # 1 and 3 fbank frames become a single encoder frame: rows of the longer sentence's
    # length are all padding for them.
    features, lengths = padded_fbank([40, 3, 1])
    out, out_lengths = encode(model, features, lengths)
    assert out_lengths.tolist() == [10, 1, 1]
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_windows_count_from_the_real_frames_of_right_padded_sentences():
    """fairseq pads speech on the right: through the encoder layers, a sentence's real frames
    are the same alone and in a batch with a longer one. (The convolutional subsampler before
    them mixes padding into the last frames, as in fairseq's s2t_transformer.)"""
    model = tiny()
    model.eval()
    layers = model.encoder.transformer_layers
    x = torch.randn(30, 2, 32)
    padding = torch.zeros(2, 30, dtype=torch.bool)
    padding[1, 11:] = True
    alone = x[:11, 1:2]
    with torch.no_grad():
        for layer in layers:
            x = layer(x, padding)
            alone = layer(alone, torch.zeros(1, 11, dtype=torch.bool))
    torch.testing.assert_close(x[:11, 1], alone[:, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "windows, message",
    [
        ("0,0,3,5,5", "gives 5 windows but the encoder has 6 layers"),
        ("0,0,3,4,5,7", "layer 3 has window 4; a window must be odd"),
        ("0,0,3,-5,5,7", "layer 3 has window -5"),
        ("0,0,a,5,5,7", "expected comma-separated integers"),
    ],
)
def test_bad_windows_are_rejected_naming_the_option(windows, message):
    with pytest.raises(ValueError, match="--encoder-attention-windows") as error:
        tiny(encoder_attention_windows=windows)
    assert message in str(error.value)


def test_other_depths_need_explicit_windows():
    with pytest.raises(ValueError, match="no default for 8 encoder layers"):
        tiny(encoder_layers=8)
    model = tiny(encoder_layers=3, encoder_attention_windows="0,1,9")
    assert model.encoder.attention_windows == [0, 1, 9]


def test_bad_attention_form_is_rejected():
    with pytest.raises(ValueError, match="--local-attention-form 'dense'"):
        tiny("dense")


def test_fairseq_train_then_generate_without_extra_options(tmp_path_factory):
    data, checkpoint = asr_checkpoint(tmp_path_factory)
    result = fairseq_cli(
        "fairseq-generate", data, "--user-dir", USER_DIR, "--task", "speech_to_text",
        "--config-yaml", "config_asr.yaml", "--gen-subset", "dev_asr", "--path", checkpoint,
        "--max-tokens", 4000, "--beam", 2, "--required-batch-size-multiple", 1,
    )  # fmt: skip
    hypotheses = [line for line in result.stdout.splitlines() if line.startswith("H-")]
    assert len(hypotheses) == 8
    assert "Generate dev_asr" in result.stdout


def st_model_args(data, *extra):
    """fairseq-train's arguments for a tiny ST model, parsed as fairseq-train parses them."""
    parser = options.get_training_parser()
    return options.parse_args_and_arch(
        parser,
        [str(data), "--user-dir", USER_DIR, "--task", "speech_to_text", "--config-yaml",
         "config_st.yaml", "--arch", "s2t_transformer_local_tiny", "--encoder-embed-dim", "32",
         "--encoder-ffn-embed-dim", "64", "--decoder-embed-dim", "32", "--conv-channels", "32",
         *map(str, extra)],
    )  # fmt: skip


def test_asr_encoder_initialises_the_st_model(tmp_path_factory):
    """--load-pretrained-encoder-from, through fairseq's option parsing and task, as
    fairseq-train builds the ST model; the saved arguments then no longer need the file."""
    data, checkpoint = asr_checkpoint(tmp_path_factory)
    args = st_model_args(data, "--load-pretrained-encoder-from", checkpoint)
    task = tasks.setup_task(args)
    model = task.build_model(args)
    asr = checkpoint_utils.load_checkpoint_to_cpu(str(checkpoint))["model"]
    encoder = model.encoder.state_dict()
    assert encoder.keys() == {k[len("encoder.") :] for k in asr if k.startswith("encoder.")}
    for name, value in encoder.items():
        torch.testing.assert_close(value, asr[f"encoder.{name}"])
    assert args.load_pretrained_encoder_from is None


@pytest.mark.parametrize("st_ctc", [False, True], ids=["st", "st-with-ctc"])
def test_ctc_trained_asr_encoder_initialises_st_without_its_ctc_projection(tmp_path, st_ctc):
    """ASR trained by fairseq-train with fairseq's CTC loss has a CTC projection onto the ASR
    vocabulary in its encoder; the ST encoder takes every other weight, and keeps its own
    projection (onto the ST vocabulary) when it has CTC too."""
    data = write_speech_data(tmp_path / "data")
    # given after train_s2t's own --criterion, this one wins
    ctc = ["--criterion", "label_smoothed_cross_entropy_with_ctc", "--ctc-weight", "0.3"]
    log = train_s2t(data, tmp_path / "asr", "asr", *ctc)
    assert "ctc_loss" in log.stdout + log.stderr
    asr_checkpoint_path = tmp_path / "asr" / "checkpoint_last.pt"
    asr_state = checkpoint_utils.load_checkpoint_to_cpu(str(asr_checkpoint_path))["model"]
    asr = {k[len("encoder.") :]: v for k, v in asr_state.items() if k.startswith("encoder.")}
    assert "ctc_proj.weight" in asr

    args = st_model_args(data, *(ctc if st_ctc else []), "--load-pretrained-encoder-from",
                         asr_checkpoint_path)  # fmt: skip
    torch.manual_seed(0)
    encoder = tasks.setup_task(args).build_model(args).encoder.state_dict()
    projection = {k for k in encoder if k.startswith("ctc_proj.")}
    assert bool(projection) is st_ctc
    assert encoder.keys() - projection == {k for k in asr if not k.startswith("ctc_proj.")}
    for name, value in encoder.items():
        if name in projection:
            assert not torch.equal(value, asr[name]), name  # its own, freshly initialised
        else:
            torch.testing.assert_close(value, asr[name])


def test_pretrained_encoder_of_another_shape_is_a_clear_error(tmp_path_factory):
    data, checkpoint = asr_checkpoint(tmp_path_factory)
    args = st_model_args(data, "--encoder-layers", 4, "--encoder-attention-windows", "0,0,0,0",
                         "--load-pretrained-encoder-from", checkpoint)  # fmt: skip
    message = r"parameters do not fit this model's: 32 unexpected \(transformer_layers\.4\."
    with pytest.raises(ValueError, match=message):
        tasks.setup_task(args).build_model(args)


def test_missing_pretrained_encoder_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="--load-pretrained-encoder-from"):
        tiny(load_pretrained_encoder_from=str(tmp_path / "absent.pt"))
