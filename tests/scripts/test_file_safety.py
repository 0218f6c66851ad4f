"""The scripts never delete or overwrite what they did not write, and write atomically."""

import os

import pytest
import torch

from local_attn_fairseq.file_safety import OWNER_MARKER, replace_own_dir
from local_attn_fairseq.modules import head_pruning

from ..conftest import REPO, run_script, snapshot, train_tiny
from .speech_corpus import SCRIPTS, needs_espeak

SYNTHESIZER = os.path.join(SCRIPTS, "synthesize_speech_corpus.py")
PREPARER = os.path.join(SCRIPTS, "prepare_mustc.py")
PRUNER = os.path.join(REPO, "scripts", "prune_heads.py")


def run(script, *args):
    """A script of the repository with `args`, in this process (tests/conftest.py run_script)."""
    return run_script(os.path.relpath(script, REPO), *args)


def test_replace_own_dir_removes_only_its_own_folders(tmp_path):
    ours = tmp_path / "ours"
    replace_own_dir(str(ours), "tool")
    (ours / "old.txt").write_text("from the last run")
    replace_own_dir(str(ours), "tool")
    assert os.listdir(ours) == [OWNER_MARKER]
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "data.txt").write_text("a user's")
    with pytest.raises(FileExistsError):
        replace_own_dir(str(theirs), "tool")
    assert (theirs / "data.txt").read_text() == "a user's"


# ---- synthesize_speech_corpus.py --------------------------------------------------------------


@pytest.fixture
def pairs_dir(tmp_path):
    pairs = tmp_path / "pairs"
    pairs.mkdir()
    for name in ("train", "valid", "test"):
        (pairs / f"{name}.de").write_text("Das ist gut.\n")
        (pairs / f"{name}.en").write_text("That is good.\n")
    return pairs


def synthesize(out_dir, pairs_dir, *extra):
    sizes = ["--train-size", 1, "--dev-size", 1, "--test-size", 1, "--workers", 1]
    return run(SYNTHESIZER, "--out-dir", out_dir, "--pairs-dir", pairs_dir, *sizes, *extra)


def mustc_root(root):
    """A MuST-C-like root: a user's recordings and transcripts."""
    for split in ("train", "dev", "tst-COMMON"):
        (root / "en-de" / "data" / split / "wav").mkdir(parents=True)
        (root / "en-de" / "data" / split / "wav" / "ted_1.wav").write_bytes(b"RIFF real talk")
    (root / "en-es" / "data" / "train" / "txt").mkdir(parents=True)
    (root / "en-es" / "data" / "train" / "txt" / "train.es").write_text("Hola.\n")
    return root


@needs_espeak
def test_synthesis_refuses_a_users_corpus_root(tmp_path, pairs_dir):
    root = mustc_root(tmp_path / "MUSTC_v1.0")
    before = snapshot(root)
    proc = synthesize(root, pairs_dir)
    assert proc.returncode != 0 and "is not empty" in proc.stderr and "--overwrite" in proc.stderr
    # --overwrite writes into the root, but a split folder it did not write is never replaced
    proc = synthesize(root, pairs_dir, "--overwrite")
    assert proc.returncode != 0 and "was not written by synthesize_speech_corpus" in proc.stderr
    after = snapshot(root)
    assert {k: v for k, v in after.items() if not k.endswith(OWNER_MARKER)} == before


@needs_espeak
def test_synthesis_with_overwrite_keeps_other_files_and_replaces_its_own(tmp_path, pairs_dir):
    root = tmp_path / "MUSTC_v1.0"
    (root / "en-es" / "data").mkdir(parents=True)
    (root / "en-es" / "data" / "notes.txt").write_text("a user's")
    proc = synthesize(root, pairs_dir, "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert (root / "en-es" / "data" / "notes.txt").read_text() == "a user's"
    train = root / "en-de" / "data" / "train"
    assert sorted(os.listdir(train / "wav")) == ["ted_1.wav"]
    (train / "wav" / "ted_9.wav").write_bytes(b"left over from an earlier run")
    # its own output is regenerated: stale talks go, the user's files elsewhere stay
    assert synthesize(root, pairs_dir).returncode == 0
    assert sorted(os.listdir(train / "wav")) == ["ted_1.wav"]
    assert (root / "en-es" / "data" / "notes.txt").read_text() == "a user's"


# ---- prepare_mustc.py -------------------------------------------------------------------------


def test_preparation_refuses_to_replace_files_it_did_not_write(tmp_path):
    lang_dir = tmp_path / "en-de"
    (lang_dir / "data" / "train" / "txt").mkdir(parents=True)
    (lang_dir / "train_st.tsv").write_text("id\taudio\n")  # fairseq's own preparation
    proc = run(PREPARER, "--mustc-root", tmp_path, "--lang", "de")
    assert proc.returncode != 0 and "already holds train_st.tsv" in proc.stderr
    assert (lang_dir / "train_st.tsv").read_text() == "id\taudio\n"


# ---- prune_heads.py ---------------------------------------------------------------------------


def test_pruning_refuses_to_write_over_its_input(tmp_path):
    checkpoint = tmp_path / "a.pt"
    checkpoint.write_bytes(b"a checkpoint")
    for output in (checkpoint, tmp_path / "." / "a.pt"):
        proc = run(PRUNER, checkpoint, output)
        assert proc.returncode == 2 and "is the input file" in proc.stderr
    assert checkpoint.read_bytes() == b"a checkpoint"


def test_an_interrupted_pruning_leaves_the_old_output(tiny_data, tmp_path, monkeypatch):
    train_tiny(tiny_data, tmp_path / "gated", "--head-gates", "enc", max_update=1)
    output = tmp_path / "pruned.pt"
    output.write_bytes(b"the pruned checkpoint of yesterday")

    def killed_mid_write(obj, path):
        with open(path, "wb") as f:
            f.write(b"half a chec")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed_mid_write)
    with pytest.raises(KeyboardInterrupt):
        head_pruning.prune_checkpoint(str(tmp_path / "gated" / "checkpoint_last.pt"), str(output))
    assert output.read_bytes() == b"the pruned checkpoint of yesterday"
    assert sorted(os.listdir(tmp_path)) == ["gated", "pruned.pt"]  # no temporary left
