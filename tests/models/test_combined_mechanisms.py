"""Every mechanism in one model, through fairseq's command line: fixed masks and tied Wq/Wk
(within and across layers), Gaussian localness, dynamic windows (also in cross-attention),
local heads on the banded operator, relative positions and head gates on all three attention
types, trained with the L0 criterion, then generated from and decoded step by step."""

import pytest
import torch
from fairseq import checkpoint_utils

from local_attn_fairseq.locality.spec import LocalitySpecError

from ..conftest import TRAIN, USER_DIR, fairseq_cli
from .helpers import assert_incremental_decoding_matches_full_forward, build_model, generate

# Encoder layer 2 is all local heads: with relative positions kept to the decoder, it runs
# on the banded operator. Decoder layer 1 borrows layer 0's head 7 ("@0.7" in "all").
COMBINED_SPEC = (
    "{encoder_self: {"
    "0-1: [band-1, band-2@0, prev-1@0, next-1, gaussian, band-1+gaussian@4, mw, aw@1.7],"
    " 2: [local-1, local-2, local-1@0, local-3, local-2-0, local-0-2, local-4, local-4@6]},"
    " decoder_self: {all: [local-2-0, band-1, prev-1@1, gaussian, mw, aw, global, global@0.7]},"
    " decoder_cross: {all: [global, global@0, aw-seg3, aw-seg3@2, mw, gaussian, global, aw]}}"
)
MODEL_DIMS = (
    "--encoder-embed-dim 32 --encoder-ffn-embed-dim 64 --encoder-layers 3 "
    "--encoder-attention-heads 8 --decoder-embed-dim 32 --decoder-ffn-embed-dim 64 "
    "--decoder-layers 2 --decoder-attention-heads 8 --share-all-embeddings"
).split()
COMBINED_MODEL = ["--arch", "transformer_local", *MODEL_DIMS, "--locality-config", COMBINED_SPEC]
COMBINED_OPTIONS = (
    "--relative-positions 4 --relative-positions-values --relative-positions-attention "
    "decoder_self --head-gates enc,dec,cross --criterion label_smoothed_cross_entropy_l0 "
    "--l0-lambda 0.05"
).split()
# Parameter names of every kind of parameter the mechanisms add.
PARAMETER_KINDS = (
    "head_gates.log_alpha",
    "localness.w_p",
    "localness.u_d",
    "dynamic_windows.0.query_pointers",
    "dynamic_windows.1.key_pointers",
    "local_q_proj",
    "local_k_proj",
    "relative_positions.key_embeddings",
    "relative_positions.value_embeddings",
)


def test_every_mechanism_in_one_model_trains_generates_and_decodes(tiny_data, tmp_path):
    proc = fairseq_cli(
        "fairseq-train", tiny_data / "bin", "--user-dir", USER_DIR, *COMBINED_MODEL, *TRAIN,
        *COMBINED_OPTIONS, "--max-update", 2, "--save-dir", tmp_path,
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    assert "num_updates 2" in log and "open_enc 24" in log and "open_cross 16" in log
    checkpoint = tmp_path / "checkpoint_last.pt"
    generate(tiny_data, checkpoint)

    (model,), _, task = checkpoint_utils.load_model_ensemble_and_task([str(checkpoint)])
    names = [n for n, _ in model.named_parameters()]
    for kind in PARAMETER_KINDS:
        assert any(kind in n for n in names), f"the model has no {kind} parameter"
    encoder, decoder = model.encoder.layers, model.decoder.layers
    assert encoder[2].self_attn.all_heads_local
    assert encoder[0].self_attn.head_to_group[:3].tolist() == [0, 0, 0]
    assert (1, 7) in encoder[0].self_attn.qk_sources and (0, 7) in decoder[1].self_attn.qk_sources
    assert_incremental_decoding_matches_full_forward(model, task)


# Heads joining a local window with Gaussian localness or a dynamic window, Gaussian heads and
# windows in cross-attention, and gates, localness and windows in pruned layers.
MIXED_HEADS = (
    "[local-2+gaussian, local-1-0+aw, band-2+gaussian+mw, global, global, global, global, global]"
)
MORE_COMBINATIONS = [
    "--locality-config",
    f"{{encoder_self: {{0: {MIXED_HEADS}}}, decoder_self: {{all: {MIXED_HEADS}}}}}",
    "--dynamic-window",
    "encoder_self:aw:1 decoder_self:mw:0 decoder_cross:aw-seg:0",
    "--localness-layers",
    "encoder_self:0 decoder_cross:1",
    "--head-gates",
    "enc,dec,cross",
    "--heads-kept",
    "{encoder_self: [4, [1, 3], 0], decoder_self: [2, 8], decoder_cross: [[0, 5], 1]}",
]


def test_more_combinations_train_and_decode(tiny_data):
    model, task, _ = build_model(
        tiny_data / "bin", "transformer_local", *MODEL_DIMS, *MORE_COMBINATIONS
    )
    assert model.encoder.layers[0].self_attn.num_qk_groups == 8  # Gaussian: every head's Q/K
    assert model.encoder.layers[0].self_attn.num_heads == 4
    assert_incremental_decoding_matches_full_forward(model, task)
    model.train()
    src = torch.randint(4, 100, (3, 7))
    src[1, :2] = task.source_dictionary.pad()
    prev = torch.randint(4, 100, (3, 5))
    prev[2, 3:] = task.target_dictionary.pad()
    out = model(src, torch.tensor([7, 5, 7]), prev)[0]
    out.sum().backward()
    assert torch.isfinite(out).all()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


def layer0(attn_type, head0):
    """--locality-config for layer 0 of one attention type: head 0 as given, 7 global heads."""
    return ["--locality-config", f"{{{attn_type}: {{0: [{head0}" + ", global" * 7 + "]}}"]


CROSS_GLOBAL_ONLY = "cross-attention heads can only be global"
WHOLE_SEGMENTS = "segment-based windows need whole segments"
REJECTED = [
    (layer0("decoder_cross", "band-1"), CROSS_GLOBAL_ONLY),
    (layer0("decoder_cross", "local-2"), CROSS_GLOBAL_ONLY),
    (layer0("decoder_self", "mw-seg"), WHOLE_SEGMENTS),
    (["--dynamic-window", "decoder_self:aw-seg:0"], WHOLE_SEGMENTS),
    (layer0("decoder_self", "next-1"), "attends only to future tokens"),
    (layer0("encoder_self", "band-1+local-2"), "combines more than one mask"),
    (layer0("encoder_self", "mw+aw"), "combines more than one dynamic window"),
    (["--relative-positions", 4, "--relative-positions-attention", "decoder_cross"],
     "is not a self-attention type"),
    (layer0("encoder_self", "global@0.0.1"), "is not H or L.H"),
]  # fmt: skip


@pytest.mark.parametrize("options,message", REJECTED)
def test_invalid_combination_is_rejected_with_a_clear_error(tiny_data, options, message):
    with pytest.raises(LocalitySpecError, match="--locality-config and the options") as error:
        build_model(tiny_data / "bin", "transformer_local", *MODEL_DIMS, *options)
    assert message in str(error.value)
