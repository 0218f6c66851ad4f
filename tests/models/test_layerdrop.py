"""LayerDrop and ``layers_to_keep`` with Q/K tied across layers, for every stack of the plugin.

fairseq's ``LayerDropModuleList`` skips layers at random whenever it is iterated in training
mode, as it is right after construction: a model built with LayerDrop must still bind each
borrowing layer to its true owner and be the model built without it. ``*_layers_to_keep`` (the
reason LayerDrop exists) must keep each kept layer's own heads and ties.
"""

import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.data import Dictionary
from fairseq.modules import LayerDropModuleList

from local_attn_fairseq.locality.spec import LocalitySpecError
from local_attn_fairseq.models.s2t_transformer_local import (
    S2TTransformerLocalModel,
    s2t_transformer_local_tiny,
)

from ..conftest import USER_DIR, fairseq_cli
from ..speech_data import build_s2t
from .helpers import build_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HEADS = 4
# Ties across layers in every attention type, with Gaussian and dynamic-window heads among the
# borrowers: encoder layer 1 borrows from layer 0 and layer 2 from layer 1, layer 3 is global;
# decoder layer 2 borrows from layer 1, which owns all of its Wq/Wk.
SPEC = """{
  encoder_self: {
    0: [band-1, global, prev-1, global],
    1: [band-2@0.0, global@0.1, next-1+gaussian, global],
    2: [global@1.3, mw, global, band-1@1.2]},
  decoder_self: {
    0: [prev-1, global, global, global],
    1: [global, prev-2, global, global],
    2: [global@1.0, global, global@1.1, global]},
  decoder_cross: {2: [global@1.0, global, global, global@1.3]}}"""
MT_DIMS = (
    "--encoder-embed-dim 16 --encoder-ffn-embed-dim 32 --encoder-layers 4 "
    f"--encoder-attention-heads {HEADS} --decoder-embed-dim 16 --decoder-ffn-embed-dim 32 "
    f"--decoder-layers 3 --decoder-attention-heads {HEADS} --share-all-embeddings"
).split()
LM_SPEC = (
    "{decoder_self: {0: [prev-1, global, global, global], "
    "1-2: [global@0.0, global@0.1, gaussian, global]}}"
)
LM_DIMS = (
    "--task language_modeling --decoder-embed-dim 16 --decoder-ffn-embed-dim 32 "
    f"--decoder-layers 3 --decoder-attention-heads {HEADS} --tokens-per-sample 32"
).split()
ENCODER_SPEC = (
    "{encoder_self: {0: [band-1, global, global, global], "
    "1-2: [global@0.0, mw, global@0.1, global]}}"
)
ROBERTA_DIMS = (
    "--task masked_lm --encoder-embed-dim 16 --encoder-ffn-embed-dim 32 --encoder-layers 3 "
    f"--encoder-attention-heads {HEADS} --tokens-per-sample 32"
).split()
WORDS = "the a house cat sat on mat dog ran far".split()
SEEDS = range(12)


@pytest.fixture(scope="module")
def data_dirs(tmp_path_factory):
    """Dictionaries as fairseq-preprocess writes them, for the translation, LM and masked-LM
    tasks (building a model needs nothing else)."""
    root = tmp_path_factory.mktemp("layerdrop_dicts")
    dictionary = Dictionary()
    for word in WORDS:
        dictionary.add_symbol(word)
    for name in ("dict.de.txt", "dict.en.txt", "dict.txt"):
        dictionary.save(str(root / name))
    return root


def build(data_dirs, family, *extra):
    if family == "mt":
        args = ("--arch", "transformer_local", "-s", "de", "-t", "en", *MT_DIMS)
        return build_model(data_dirs, args[1], *args[2:], "--locality-config", SPEC, *extra)[0]
    if family == "lm":
        return build_model(
            data_dirs, "transformer_lm_local", *LM_DIMS, "--locality-config", LM_SPEC, *extra
        )[0]
    return build_model(
        data_dirs, "roberta_local", *ROBERTA_DIMS, "--locality-config", ENCODER_SPEC, *extra
    )[0]


def stacks(model):
    """(name, layer list) of every stack of local attention layers in the model."""
    if hasattr(model, "encoder") and hasattr(model.encoder, "sentence_encoder"):
        return [("encoder", model.encoder.sentence_encoder.layers)]
    found = []
    for name in ("encoder", "decoder"):
        part = getattr(model, name, None)
        if part is not None and hasattr(part, "layers"):
            found.append((name, part.layers))
    return found


def assert_bound_to_true_owners(model):
    for name, layers in stacks(model):
        for attribute in ("self_attn", "encoder_attn"):
            modules = [getattr(layers[i], attribute, None) for i in range(len(layers))]
            for module in modules:
                for layer, owner in getattr(module, "_qk_owner_modules", {}).items():
                    assert owner is modules[layer], f"{name} {attribute} layer {module.layer_index}"


def same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def eval_output(model, family):
    tokens = torch.tensor([[4, 5, 6, 7, 8, 9, 2], [1, 1, 4, 6, 8, 10, 2]])
    model.eval()
    with torch.no_grad():
        if family == "mt":
            lengths = (tokens != 1).sum(1)
            return model(tokens, lengths, tokens)[0]
        if family == "lm":
            return model(tokens[:1])[0]
        return model(tokens[:1])[0]


@pytest.mark.parametrize("family", ["mt", "lm", "roberta"])
def test_a_model_built_with_layerdrop_is_the_model_built_without_it(data_dirs, family):
    drop = {
        "mt": ["--encoder-layerdrop", "0.5", "--decoder-layerdrop", "0.5"],
        "lm": ["--decoder-layerdrop", "0.5"],
        "roberta": ["--encoder-layerdrop", "0.5"],
    }[family]
    for seed in SEEDS:
        torch.manual_seed(seed)
        with_drop = build(data_dirs, family, *drop)
        torch.manual_seed(seed)
        without = build(data_dirs, family)
        assert any(isinstance(layers, LayerDropModuleList) for _, layers in stacks(with_drop))
        assert_bound_to_true_owners(with_drop)
        assert same_state(with_drop, without), f"seed {seed}"
        torch.testing.assert_close(eval_output(with_drop, family), eval_output(without, family))


def test_the_speech_model_with_decoder_layerdrop_is_the_model_without_it():
    # fairseq's S2T encoder has no LayerDrop; its decoder does.
    for seed in SEEDS:
        torch.manual_seed(seed)
        with_drop = build_s2t(
            S2TTransformerLocalModel, s2t_transformer_local_tiny, decoder_layerdrop=0.5
        )
        torch.manual_seed(seed)
        without = build_s2t(S2TTransformerLocalModel, s2t_transformer_local_tiny)
        assert isinstance(with_drop.decoder.layers, LayerDropModuleList)
        assert same_state(with_drop, without), f"seed {seed}"


def seed_dropping_only(layer_count, dropped, p):
    """A seed under which LayerDropModuleList's draw drops exactly the layers in ``dropped``."""
    for seed in range(10_000):
        torch.manual_seed(seed)
        draw = torch.empty(layer_count).uniform_()
        if [i for i in range(layer_count) if draw[i] <= p] == dropped:
            return seed
    raise AssertionError("no seed drops exactly those layers")


def test_a_dropped_owner_still_serves_its_borrowers_in_training(data_dirs):
    """Layer 0 owns the Wq/Wk that layers 1 and 2 use: when LayerDrop skips layer 0, its
    feed-forward gets no gradient but its Wq/Wk do, through the layers that borrow them."""
    model = build(
        data_dirs, "roberta", "--encoder-layerdrop", "0.5", "--dropout", "0",
        "--attention-dropout", "0",
    )  # fmt: skip
    model.train()
    layers = model.encoder.sentence_encoder.layers
    tokens = torch.tensor([[0, 4, 5, 6, 7, 8, 9, 2]])
    torch.manual_seed(seed_dropping_only(len(layers), [0], 0.5))
    out = model.encoder.sentence_encoder(tokens)["encoder_out"][0]
    out.float().pow(2).sum().backward()
    owner = layers[0]
    assert owner.fc1.weight.grad is None
    assert owner.self_attn.q_proj.weight.grad is not None
    assert owner.self_attn.q_proj.weight.grad.abs().sum() > 0
    assert layers[1].fc1.weight.grad is not None


# -- layers_to_keep ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_mt(tiny_data, tmp_path_factory):
    """Two updates of a tiny model with the spec above and LayerDrop, through fairseq-train."""
    save_dir = tmp_path_factory.mktemp("layerdrop_mt")
    fairseq_cli(
        "fairseq-train", tiny_data / "bin", "--user-dir", USER_DIR, "--arch", "transformer_local",
        *MT_DIMS, "--locality-config", SPEC, "--encoder-layerdrop", "0.2",
        "--decoder-layerdrop", "0.2", "--optimizer", "adam", "--lr", "1e-3", "--max-tokens",
        "1000", "--num-workers", "0", "--seed", "1", "--max-update", "2", "--no-progress-bar",
        "--no-epoch-checkpoints", "--save-dir", save_dir,
    )  # fmt: skip
    return save_dir / "checkpoint_last.pt"


def load(checkpoint, **overrides):
    models, _ = checkpoint_utils.load_model_ensemble([str(checkpoint)], arg_overrides=overrides)
    return models[0].eval()


def test_layers_to_keep_keeps_each_layers_heads_ties_and_weights(trained_mt):
    full = load(trained_mt)
    kept_encoder, kept_decoder = [0, 1, 3], [1, 2]
    pruned = load(trained_mt, encoder_layers_to_keep="0,1,3", decoder_layers_to_keep="1,2")
    assert len(pruned.encoder.layers) == 3 and len(pruned.decoder.layers) == 2
    for kept, pruned_layers, full_layers, types in (
        (kept_encoder, pruned.encoder.layers, full.encoder.layers, ["self_attn"]),
        (kept_decoder, pruned.decoder.layers, full.decoder.layers, ["self_attn", "encoder_attn"]),
    ):
        for new, old in enumerate(kept):
            assert same_state(pruned_layers[new], full_layers[old])
            for attribute in types:
                a = getattr(pruned_layers[new], attribute)
                b = getattr(full_layers[old], attribute)
                assert [(h.mask, h.gaussian, h.window) for h in a.head_specs] == [
                    (h.mask, h.gaussian, h.window) for h in b.head_specs
                ]
    # decoder layer 2 (now 1) borrows the Wq/Wk of layer 1 (now 0), self- and cross-attention
    borrower = pruned.decoder.layers[1]
    assert borrower.self_attn._qk_owner_modules[0] is pruned.decoder.layers[0].self_attn
    assert borrower.encoder_attn._qk_owner_modules[0] is pruned.decoder.layers[0].encoder_attn
    # The pruned model computes what the full model computes with those layers skipped.
    full.encoder.layers = torch.nn.ModuleList(full.encoder.layers[i] for i in kept_encoder)
    full.decoder.layers = torch.nn.ModuleList(full.decoder.layers[i] for i in kept_decoder)
    torch.testing.assert_close(eval_output(pruned, "mt"), eval_output(full, "mt"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"encoder_layers_to_keep": "1,2,3"},
            "encoder_self layer 1 head 0 uses the Wq/Wk of layer 0 head 0, which would be removed",
        ),
        (
            {"encoder_layers_to_keep": "0,2"},
            "encoder_self layer 2 head 0 uses the Wq/Wk of layer 1 head 3, which would be removed",
        ),
        (
            {"decoder_layers_to_keep": "0,2"},
            "decoder_self layer 2 head 0 uses the Wq/Wk of layer 1 head 0",
        ),
        ({"encoder_layers_to_keep": "0,5"}, "layer 5 does not exist; the model has 4"),
    ],
)
def test_layers_to_keep_that_would_cut_a_tie_is_refused_naming_it(trained_mt, overrides, message):
    with pytest.raises(LocalitySpecError, match=message):
        load(trained_mt, **overrides)


def test_fairseq_generate_with_layers_to_keep(tiny_data, trained_mt):
    proc = fairseq_cli(
        "fairseq-generate", tiny_data / "bin", "--user-dir", USER_DIR, "--path", trained_mt,
        "--gen-subset", "test", "--beam", "2", "--max-len-b", "5", "--batch-size", "16",
        "--num-workers", "0", "--model-overrides", "{'encoder_layers_to_keep': '0,1,3'}",
    )  # fmt: skip
    assert sum(line.startswith("H-") for line in proc.stdout.splitlines()) == 40
    assert "encoder_self layer 1:" in proc.stdout + proc.stderr


@pytest.mark.parametrize("family", ["lm", "roberta"])
def test_training_a_cut_down_model_from_a_spec(data_dirs, family):
    option = "--decoder-layers-to-keep" if family == "lm" else "--encoder-layers-to-keep"
    model = build(data_dirs, family, option, "0,2")
    (_, layers), = stacks(model)
    assert len(layers) == 2
    # original layer 2 borrows layer 0's Wq/Wk: it is now layer 1, bound to layer 0
    assert layers[1].self_attn._qk_owner_modules[0] is layers[0].self_attn
    with pytest.raises(LocalitySpecError, match="which would be removed; keep layer 0"):
        build(data_dirs, family, option, "1,2")


@pytest.mark.parametrize(
    "family, arch, extra, keep",
    [
        # Dec(MW) in layers 0-2: layer 3 alone keeps no window
        ("lm", "transformer_lm_dynwin_tiny", ["--decoder-layers", 4],
         ["--decoder-layers-to-keep", "3"]),
        # Enc(AW) in layers 0-2 and no cross windows: encoder layer 3 alone keeps no window
        ("mt", "transformer_dynwin_tiny", ["--dynamic-window", "decoder_cross:none"],
         ["--encoder-layers-to-keep", "3"]),
    ],
)  # fmt: skip
def test_a_cut_that_leaves_no_window_is_rebuilt_without_the_archs_default_windows(
    data_dirs, family, arch, extra, keep
):
    """The cut model's arguments (what its checkpoint stores) rebuild the same model: the
    dynwin archs' default windows must not come back to the layers that were kept without."""
    dims = LM_DIMS if family == "lm" else ("-s", "de", "-t", "en", *MT_DIMS)
    model, task, args = build_model(data_dirs, arch, *dims, *extra, *keep)
    args.encoder_layers_to_keep = args.decoder_layers_to_keep = None  # loading, as fairseq does
    rebuilt = task.build_model(args)
    assert sorted(rebuilt.state_dict()) == sorted(model.state_dict())
    cut = "decoder.layers." if family == "lm" else "encoder.layers."
    assert not any(n.startswith(cut) and "dynamic_windows" in n for n in model.state_dict())
    assert not any("encoder_attn.dynamic_windows" in n for n in model.state_dict())
    rebuilt.load_state_dict(model.state_dict(), strict=True)
