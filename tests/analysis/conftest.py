"""Fixtures of the analysis tests: a hand-written CoNLL-U file, its sentences as raw text, a
checkpoint with learned windows, a pre-LN translation checkpoint (what the contributions
decomposition takes), and the ``local-attn-analyze`` command."""

import json
from pathlib import Path

import pytest

from ..conftest import TINY_MODEL, fairseq_cli, train_tiny
from ..models.helpers import build_model

DATA = Path(__file__).parent / "data"
CONLLU = DATA / "sentences.de.conllu"
# The sentences of CONLLU as the Ding corpus writes them (punctuation attached to the word).
SOURCE_LINES = [
    "Max wartet auf Annas Anruf.",
    "Der Hund schläft im Garten hinter dem großen Haus.",
]
# Gaussian heads in encoder layer 0, dynamic windows in encoder layer 1 and the decoder.
WINDOW_MODEL = [
    "--localness-layers",
    "encoder_self:0",
    "--dynamic-window",
    "encoder_self:aw:1 decoder_self:mw:0 decoder_cross:aw-seg:0",
]


def analyze(*args, check=True, separate_process=False):
    """``local-attn-analyze`` as a user types it (its entry point in this process unless
    ``separate_process``: the installed script)."""
    return fairseq_cli("local-attn-analyze", *args, check=check, separate_process=separate_process)


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture
def source_text(tmp_path):
    path = tmp_path / "source.de"
    path.write_text("\n".join(SOURCE_LINES) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def window_checkpoint(tiny_data, tmp_path_factory):
    """fairseq-train of a tiny model with both kinds of learned windows."""
    save_dir = tmp_path_factory.mktemp("ckpt_windows")
    train_tiny(tiny_data, save_dir, *WINDOW_MODEL)
    return save_dir / "checkpoint_last.pt"


@pytest.fixture(scope="session")
def translation_checkpoint(tiny_data, tmp_path_factory):
    """fairseq-train of a tiny pre-LN de-en translation model."""
    save_dir = tmp_path_factory.mktemp("ckpt_pre_ln")
    train_tiny(tiny_data, save_dir, "--encoder-normalize-before")
    return save_dir / "checkpoint_last.pt"


def one_layer_model(tiny_data, heads_spec, *extra):
    """A one-encoder-layer model whose 8 heads follow ``heads_spec``, built by fairseq's own
    argument parsing, in eval mode."""
    dims = list(TINY_MODEL)
    dims[dims.index("--encoder-layers") + 1] = "1"
    spec = "{encoder_self: {all: [" + ", ".join([heads_spec] * 8) + "]}}"
    model, task, _ = build_model(
        tiny_data / "bin", "transformer_local", *dims, "--locality-config", spec, *extra
    )
    return model.eval(), task
