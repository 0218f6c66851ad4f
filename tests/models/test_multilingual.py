"""fairseq's multilingual translation task (``translation_multi_simple_epoch``) with the plugin's
models: one model for both directions of the tiny de-en corpus, a language token at the start of
every source (``--encoder-langtok src``) and of every target (``--decoder-langtok``).

The language token is the first real token of a left-padded source, so the position-dependent
mechanisms (Pande's masks, Yang's centres, Nguyen's windows) count positions from it; a sentence
decoded alone must get what it gets in a padded batch, as with fairseq's own ``transformer``.
"""

import re

import pytest

from ..conftest import TINY_MODEL, TRAIN, USER_DIR, fairseq_cli

MULTILINGUAL = [
    "--task", "translation_multi_simple_epoch", "--lang-pairs", "de-en,en-de",
    "--encoder-langtok", "src", "--decoder-langtok",
]  # fmt: skip

FAMILIES = {
    "control": ["--arch", "transformer"],
    "tied": ["--arch", "transformer_local_tied"],
    "localness": ["--arch", "transformer_localness"],
    "dynwin": ["--arch", "transformer_dynwin"],
    "gated": ["--arch", "transformer_local", "--head-gates", "enc,dec,cross",
              "--criterion", "label_smoothed_cross_entropy_l0"],  # fmt: skip
}


# Test sentences decoded in a batch and one at a time (a batch of one costs a generator's step
# per token of every sentence): enough to mix lengths, so that the batch pads.
TEST_SENTENCES = 12


@pytest.fixture(scope="module")
def multilingual_data(tiny_data, tmp_path_factory):
    """The tiny corpus binarised in both directions with its one joined dictionary, its test
    split cut to its first TEST_SENTENCES pairs."""
    root = tmp_path_factory.mktemp("multilingual")
    dictionary = tiny_data / "bin" / "dict.de.txt"
    for lang in ("de", "en"):
        with open(tiny_data / "small" / f"test.{lang}", encoding="utf-8") as f:
            lines = f.readlines()[:TEST_SENTENCES]
        (root / f"test.{lang}").write_text("".join(lines), encoding="utf-8")
    for src, tgt in (("de", "en"), ("en", "de")):
        prefixes = [
            option for split in ("train", "valid")
            for option in (f"--{split}pref", tiny_data / "small" / split)
        ] + ["--testpref", root / "test"]  # fmt: skip
        fairseq_cli(
            "fairseq-preprocess", "--source-lang", src, "--target-lang", tgt, *prefixes,
            "--destdir", root / "bin",
            "--srcdict", dictionary, "--tgtdict", dictionary, "--workers", 1,
        )  # fmt: skip
    (root / "langs.txt").write_text("de\nen\n")
    return root


def hypotheses(output):
    """{sentence id: (hypothesis, score)} of fairseq-generate's output."""
    found = re.findall(r"^H-(\d+)\t(\S+)\t(.*)$", output, re.M)
    return {int(i): (text, float(score)) for i, score, text in found}


@pytest.mark.parametrize("family", FAMILIES)
def test_both_directions_train_and_decode_alone_as_in_a_batch(
    multilingual_data, tmp_path, family
):
    data = multilingual_data / "bin"
    langs = ["--lang-dict", multilingual_data / "langs.txt"]
    train = list(TRAIN)
    if "--criterion" in FAMILIES[family]:  # the family's own criterion replaces TRAIN's
        at = train.index("--criterion")
        del train[at : at + 2]
    fairseq_cli(
        "fairseq-train", data, "--user-dir", USER_DIR, *FAMILIES[family], *TINY_MODEL, *train,
        *MULTILINGUAL, *langs, "--max-update", 3, "--save-dir", tmp_path, "--dropout", 0.1,
    )  # fmt: skip
    checkpoint = tmp_path / "checkpoint_last.pt"
    every = TEST_SENTENCES  # one batch
    for src, tgt, batches in (("de", "en", (every, 1)), ("en", "de", (every,))):
        decoded = {}
        for batch in batches:
            out = fairseq_cli(
                "fairseq-generate", data, "--user-dir", USER_DIR, "--path", checkpoint,
                *MULTILINGUAL, *langs, "--source-lang", src, "--target-lang", tgt,
                "--gen-subset", "test", "--beam", 2, "--max-len-b", 8, "--batch-size", batch,
                "--required-batch-size-multiple", 1, "--num-workers", 0,
            )  # fmt: skip
            decoded[batch] = hypotheses(out.stdout)
        assert sorted(decoded[every]) == list(range(TEST_SENTENCES)), (src, tgt)
        with open(multilingual_data / f"test.{src}", encoding="utf-8") as f:
            assert len({len(line.split()) for line in f}) > 1  # the batch pads some sources
        for i, (text, score) in decoded[every].items():
            assert "__en__" not in text and "__de__" not in text
            if 1 in decoded:
                alone_text, alone_score = decoded[1][i]
                assert alone_text == text and abs(alone_score - score) < 1e-4, (src, tgt, i)
