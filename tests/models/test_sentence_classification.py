"""roberta_local / roberta_dynwin_classifier with fairseq's sentence_prediction task, on the
subject-verb agreement set that scripts/prepare_classification.py builds from the Ding corpus."""

import json
import random
import re

import pytest
import torch
from fairseq import checkpoint_utils

from local_attn_fairseq.data import agreement as prepare_classification
from local_attn_fairseq.locality.spec import LocalitySpecError

from ..conftest import USER_DIR, fairseq_cli
from .helpers import build_model

TASK = (
    "--task sentence_prediction --num-classes 2 --init-token 0 --max-positions 128 "
    "--criterion sentence_prediction --classification-head-name sva"
).split()
# --required-batch-size-multiple 1: fairseq would drop a last batch smaller than 8
TRAIN = (
    "--optimizer adam --lr 1e-3 --batch-size 16 --required-batch-size-multiple 1 --seed 1 "
    "--max-update 2 --num-workers 0 --no-progress-bar --log-interval 1 --no-epoch-checkpoints "
    "--best-checkpoint-metric accuracy --maximize-best-checkpoint-metric"
).split()
WINDOW_WEIGHT = (
    "encoder.sentence_encoder.layers.{}.self_attn.dynamic_windows.0.query_pointers.weight"
)


@pytest.fixture(scope="module")
def sva_data(tiny_data):
    out = tiny_data / "sva"
    if not (out / "label" / "dict.txt").exists():
        prepare_classification.main(["--ding-dir", str(tiny_data / "small"), "--out-dir", str(out)])
    return out


@pytest.fixture(scope="module")
def trained_classifier(sva_data, tmp_path_factory):
    """fairseq-train of the tiny Enc(MW) classifier for two updates, and its log."""
    save_dir = tmp_path_factory.mktemp("sva_mw")
    proc = fairseq_cli(
        "fairseq-train", sva_data, "--user-dir", USER_DIR, "--arch",
        "roberta_dynwin_classifier_tiny", *TASK, *TRAIN, "--save-dir", save_dir,
    )  # fmt: skip
    return save_dir / "checkpoint_last.pt", proc.stdout + proc.stderr


def build_classifier(sva_data, arch, *extra):
    model, _, _ = build_model(sva_data, arch, *TASK, *extra)
    return model.eval()


def window_layers(model, name):
    params = dict(model.named_parameters())
    return sorted({int(k.split(".")[3]) for k in params if f".self_attn.{name}" in k})


def test_minimal_pairs_flip_the_number_of_one_agreement_verb():
    tokens = prepare_classification.tokenize("The boys don’t know what he is doing.")
    assert tokens == ["the", "boys", "don't", "know", "what", "he", "is", "doing", "."]
    assert prepare_classification.flippable_positions(tokens) == [2, 6]
    flips = set()
    for seed in range(20):
        good, bad = prepare_classification.minimal_pair(tokens, random.Random(seed))
        assert good == tokens and sum(a != b for a, b in zip(good, bad)) == 1
        flips.add(tuple(bad))
    assert flips == {
        ("the", "boys", "doesn't", "know", "what", "he", "is", "doing", "."),
        ("the", "boys", "don't", "know", "what", "he", "are", "doing", "."),
    }
    # the subjunctive "if I were" -> "if I was" would stay grammatical: not a candidate
    assert prepare_classification.flippable_positions(["if", "i", "were", "you"]) == []
    assert prepare_classification.minimal_pair(["we", "can", "go", "."], None) is None


def test_prepared_data_has_the_sentence_prediction_layout(sva_data):
    for field in ("input0", "label"):
        for split in ("train", "valid", "test"):
            assert (sva_data / field / f"{split}.bin").exists()
    labels = (sva_data / "raw" / "test.label").read_text().split()
    texts = (sva_data / "raw" / "test.input0").read_text().splitlines()
    assert len(labels) == len(texts) > 0
    assert labels[::2] == ["grammatical"] * (len(labels) // 2)
    assert labels[1::2] == ["ungrammatical"] * (len(labels) // 2)
    label_symbols = (sva_data / "label" / "dict.txt").read_text().split()
    assert "grammatical" in label_symbols and "ungrammatical" in label_symbols


def test_training_log_reports_valid_accuracy(trained_classifier):
    _, log = trained_classifier
    assert re.search(r"valid on 'valid' subset \| .*accuracy [0-9.]+", log), log[-2000:]


def test_fairseq_validate_reports_test_accuracy(sva_data, trained_classifier):
    checkpoint, _ = trained_classifier
    proc = fairseq_cli(
        "fairseq-validate", sva_data, "--user-dir", USER_DIR, "--path", checkpoint, *TASK,
        "--valid-subset", "test", "--batch-size", 64, "--required-batch-size-multiple", 1,
        "--num-workers", 0,
    )  # fmt: skip
    found = re.search(r"valid on 'test' subset \|.* accuracy ([0-9.]+)", proc.stdout + proc.stderr)
    assert found, proc.stderr[-2000:]
    assert 0 <= float(found.group(1)) <= 100


def test_checkpoint_describes_itself(trained_classifier):
    checkpoint, _ = trained_classifier
    state = checkpoint_utils.load_checkpoint_to_cpu(str(checkpoint))
    stored = json.loads(state["cfg"]["model"].locality_config)
    assert stored["dynamic_window"]["layers"] == {"encoder_self": "mw:0"}
    assert WINDOW_WEIGHT.format(0) in state["model"]
    assert WINDOW_WEIGHT.format(1) not in state["model"]
    assert "encoder.sentence_encoder.layers.0.self_attn.local_q_proj.weight" not in state["model"]
    assert "classification_heads.sva.out_proj.weight" in state["model"]


# Band heads of the banded operator and Pande's masks in both layers, beside global heads.
LOCAL_HEADS = "{encoder_self: {all: [band-2, prev-1, next-1, global]}}"


@pytest.mark.parametrize(
    "arch,options",
    [
        ("roberta_dynwin_classifier_tiny", []),  # Enc(MW)
        ("roberta_dynwin_classifier_tiny", ["--dynamic-window", "encoder_self:aw-seg:0-1"]),
        ("roberta_local_classifier", ["--encoder-embed-dim", 32, "--encoder-ffn-embed-dim", 64,
                                      "--locality-config", LOCAL_HEADS]),
    ],
)  # fmt: skip
def test_a_sentence_is_classified_alone_as_in_a_padded_batch(sva_data, arch, options):
    """sentence_prediction pads a batch on the right: each sentence's logits in a batch of
    sentences of several lengths are those it gets alone."""
    model, task, _ = build_model(sva_data, arch, *TASK, *options)
    model.eval()
    task.load_dataset("test")
    dataset = task.dataset("test")
    samples = [dataset[i] for i in range(8)]
    padded = dataset.collater(samples)["net_input"]["src_tokens"]
    assert padded[:, -1].eq(task.source_dictionary.pad()).any()  # shorter sentences padded

    def logits(batch):
        tokens = dataset.collater(batch)["net_input"]["src_tokens"]
        return model(tokens, features_only=True, classification_head_name="sva")[0]

    with torch.no_grad():
        together = logits(samples)
        for row, sample in enumerate(samples):
            torch.testing.assert_close(together[row], logits([sample])[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "arch,options,windows,aw",
    [
        ("roberta_local_classifier", [], [], []),
        ("roberta_dynwin_classifier", [], [0], []),  # Enc(MW), first layer
        ("roberta_dynwin_classifier_tiny", ["--dynamic-window", "encoder_self:aw:0"], [0], [0]),
        ("roberta_dynwin_classifier_tiny", ["--dynamic-window", "encoder_self:aw-seg:0-1"],
         [0, 1], [0, 1]),
    ],
)  # fmt: skip
def test_enc_mw_by_default_and_aw_selectable(sva_data, arch, options, windows, aw):
    model = build_classifier(sva_data, arch, *options)
    assert window_layers(model, "dynamic_windows") == windows
    assert window_layers(model, "local_q_proj") == aw


def test_head_gates_give_the_l0_criterion_its_penalty(sva_data):
    model = build_classifier(sva_data, "roberta_dynwin_classifier_tiny", "--head-gates", "enc")
    assert model.head_gate_penalty().item() > 0
    assert model.open_heads() == {"encoder_self": {0: 4, 1: 4}}


@pytest.mark.parametrize("scale", ["sum", "per-layer-mean"])
def test_sentence_prediction_l0_adds_lambda_times_the_penalty_per_sentence(sva_data, scale):
    """The criterion fairseq-train builds: fairseq's sentence-prediction loss (summed over the
    batch's sentences) plus lambda * L_C * sentences, and the penalty and open heads logged."""
    gated = ("--head-gates", "enc", "--dropout", 0)
    model, task, args = build_model(
        sva_data, "roberta_dynwin_classifier_tiny", *TASK, *gated,
        "--criterion", "sentence_prediction_l0", "--l0-lambda", 0.5, "--l0-penalty-scale", scale,
    )  # fmt: skip
    _, _, plain_args = build_model(sva_data, "roberta_dynwin_classifier_tiny", *TASK, *gated)
    task.load_dataset("valid")
    dataset = task.dataset("valid")
    sample = dataset.collater([dataset[i] for i in range(6)])
    model.eval()
    with torch.no_grad():
        loss, size, log = task.build_criterion(args)(model, sample)
        plain, plain_size, _ = task.build_criterion(plain_args)(model, sample)
        penalty = model.head_gate_penalty(scale)
    assert size == plain_size == 6
    torch.testing.assert_close(loss, plain + 0.5 * penalty * 6)
    assert float(log["l0_penalty"]) == pytest.approx(penalty.item())
    assert log["open_enc"] == 8
    if scale == "per-layer-mean":  # two gated layers
        torch.testing.assert_close(penalty * 2, model.head_gate_penalty("sum"))


@pytest.mark.parametrize("criterion", ["sentence_prediction", "sentence_prediction_l0"])
def test_gated_classifier_warns_when_its_criterion_adds_no_l0_penalty(sva_data, tmp_path,
                                                                     criterion):
    proc = fairseq_cli(
        "fairseq-train", sva_data, "--user-dir", USER_DIR, "--arch",
        "roberta_dynwin_classifier_tiny", *TASK, *TRAIN, "--save-dir", tmp_path,
        "--head-gates", "enc", "--criterion", criterion,
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    warning = [line for line in log.splitlines() if "without the L0 penalty" in line]
    if criterion == "sentence_prediction_l0":
        assert not warning and re.search(r"l0_penalty=[\d.]+, open_enc=8,", log)
    else:
        assert len(warning) == 1 and "WARNING" in warning[0]
        assert "label_smoothed_cross_entropy_l0 or sentence_prediction_l0" in warning[0]
        assert "l0_penalty=" not in log


def test_without_a_spec_it_is_fairseqs_roberta(sva_data):
    """Same parameters and outputs as fairseq's roberta at the same sizes."""
    sizes = "--encoder-layers 2 --encoder-embed-dim 32 --encoder-ffn-embed-dim 64".split()
    sizes += ["--encoder-attention-heads", "4"]
    ours = build_classifier(sva_data, "roberta_local", *sizes)
    theirs = build_classifier(sva_data, "roberta", *sizes)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    tokens = torch.tensor([[0, 10, 11, 12, 13, 2, 1, 1], [0, 14, 15, 2, 1, 1, 1, 1]])
    with torch.no_grad():
        expected = theirs(tokens, classification_head_name="sva")[0]
        torch.testing.assert_close(ours(tokens, classification_head_name="sva")[0], expected)


@pytest.mark.parametrize(
    "options,message",
    [
        (["--dynamic-window", "decoder_self:mw:0"], "dynamic_window layers decoder_self"),
        (["--locality-config", "{decoder_cross: {0: [global, global, global, global]}}"],
         "no decoder_cross attention"),
        (["--head-gates", "dec"], "no decoder_self attention"),
        (["--relative-positions", 4, "--relative-positions-attention", "decoder_self"],
         "relative_positions: this model has no decoder_self attention"),
    ],
)  # fmt: skip
def test_spec_rejects_decoder_settings(sva_data, options, message):
    with pytest.raises(LocalitySpecError, match=r"attention types: encoder_self\)") as error:
        build_classifier(sva_data, "roberta_dynwin_classifier_tiny", *options)
    assert message in str(error.value)
