"""The small synthetic MuST-C corpus the speech tests share, built once per test session.

24 train / 6 dev / 6 tst-COMMON utterances spoken by espeak-ng, three utterances per talk wav (so
the segments carry real offsets), prepared by ``scripts/data/prepare_mustc.py`` into fbank
manifests and into raw-WAV manifests. Both the data-preparation tests and the fairseq CLI tests
use it, so the builders cache their results at module level.
"""

import os
import shutil
import subprocess
import sys

import pytest
import yaml

from ..conftest import REPO

SCRIPTS = os.path.join(REPO, "scripts", "data")
SIZES = {"train": 24, "dev": 6, "tst-COMMON": 6}
UTTERANCES_PER_TALK = 3
VOCAB_SIZE = 120

_BUILT = {}

needs_espeak = pytest.mark.skipif(not shutil.which("espeak-ng"), reason="espeak-ng speaks")
needs_diatheke = pytest.mark.skipif(
    not shutil.which("diatheke"), reason="diatheke reads the SWORD Bibles"
)


def run_script(name, *args):
    """Run one of the data scripts as a user does; returns its stdout."""
    cmd = [sys.executable, os.path.join(SCRIPTS, name), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc.stdout


def synthetic_corpus(tmp_path_factory):
    """The MuST-C-layout root (holding en-de/data/...)."""
    if "corpus" not in _BUILT:
        root = tmp_path_factory.mktemp("synthetic_mustc")
        _BUILT["synthesis_log"] = run_script(
            "synthesize_speech_corpus.py", "--out-dir", root,
            "--train-size", SIZES["train"], "--dev-size", SIZES["dev"],
            "--test-size", SIZES["tst-COMMON"], "--utterances-per-talk", UTTERANCES_PER_TALK,
        )  # fmt: skip
        _BUILT["corpus"] = root
    return _BUILT["corpus"]


def prepared(tmp_path_factory, audio_format):
    """The fairseq data directory of the corpus: ``fbank`` or ``wav`` manifests."""
    key = f"prepared_{audio_format}"
    if key not in _BUILT:
        corpus = synthetic_corpus(tmp_path_factory)
        out = tmp_path_factory.mktemp(f"prepared_{audio_format}")
        extra = ["--cmvn", "global", "--specaugment", "lb"] if audio_format == "fbank" else []
        _BUILT[f"{key}_log"] = run_script(
            "prepare_mustc.py", "--mustc-root", corpus, "--lang", "de", "--out-dir", out,
            "--vocab-size", VOCAB_SIZE, "--audio-format", audio_format, *extra,
        )  # fmt: skip
        _BUILT[key] = out
    return _BUILT[key]


def log(name):
    return _BUILT[name]


def split_dir(root, split, pair="en-de"):
    return root / pair / "data" / split


def read_split(root, split, pair="en-de", sides=("en", "de")):
    """(yaml segments, {side: lines}) of one split of a corpus in MuST-C's layout."""
    txt = split_dir(root, split, pair) / "txt"
    with open(txt / f"{split}.yaml", encoding="utf-8") as f:
        segments = yaml.load(f, Loader=yaml.BaseLoader)
    lines = {side: (txt / f"{split}.{side}").read_text("utf-8").splitlines() for side in sides}
    return segments, lines
