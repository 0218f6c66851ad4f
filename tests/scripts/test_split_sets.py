"""scripts/prepare_ding.py and scripts/prepare_bible.py replace their split files as one set: a
run with another --seed interrupted part-way leaves the previous run's splits, never a mixture.

A kill is emulated by raising KeyboardInterrupt where one split file is renamed into place.
"""

import os

import pytest

from local_attn_fairseq.data import agreement, text
from local_attn_fairseq.file_safety import OWNER_MARKER

from ..conftest import run_script, snapshot

DING = os.path.join("scripts", "prepare_ding.py")
DING_SMALL = ["--test-size", "3", "--valid-size", "2", "--max-train", "5"]
DING_FILES = [f"{split}.{lang}" for split in ("train", "valid", "test") for lang in ("de", "en")]
BIBLE = os.path.join("scripts", "prepare_bible.py")
BIBLE_SMALL = ["--books", "Ruth,Romans,Jude", "--max-train", "5", "--test-size", "5"]


def kill_at_rename_of(monkeypatch, name):
    """The process 'dies' when the file `name` is renamed into place (every file before it in
    the tool's order was written)."""
    rename = os.replace

    def replace(source, destination, *args, **kwargs):
        if os.path.basename(destination) == name:
            raise KeyboardInterrupt
        return rename(source, destination, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)


def run(script, *argv):
    proc = run_script(script, *argv)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def killed_run(monkeypatch, script, name, *argv):
    with monkeypatch.context() as patched:
        kill_at_rename_of(patched, name)
        with pytest.raises(KeyboardInterrupt):
            run_script(script, *argv)


def test_prepare_ding_with_another_seed_killed_leaves_the_first_runs_splits(tmp_path, monkeypatch):
    out = tmp_path / "ding"
    run(DING, "--out-dir", out, *DING_SMALL, "--seed", "1")
    first = snapshot(out)
    # train.en is written last: every other split of seed 2 was written before the kill
    killed_run(monkeypatch, DING, "train.en", "--out-dir", out, *DING_SMALL, "--seed", "2")
    assert snapshot(out) == first
    assert sorted(os.listdir(tmp_path)) == ["ding"]  # no staging folder left behind
    # the next run writes seed 2's splits, all of them, as a fresh folder has them
    run(DING, "--out-dir", out, *DING_SMALL, "--seed", "2")
    run(DING, "--out-dir", tmp_path / "fresh", *DING_SMALL, "--seed", "2")
    assert snapshot(out) == snapshot(tmp_path / "fresh") != first
    assert sorted(os.listdir(tmp_path)) == ["ding", "fresh"]


def test_prepare_ding_into_a_shared_folder_marks_a_killed_replacement(tmp_path, monkeypatch):
    """Under --overwrite, in a folder holding other files, the set is replaced in place: a kill
    leaves a record that the readers refuse, and the next run removes it."""
    out = tmp_path / "shared"
    out.mkdir()
    (out / "notes.txt").write_text("the user's\n")
    run(DING, "--out-dir", out, *DING_SMALL, "--seed", "1", "--overwrite")
    assert text.splits_complete(out, DING_FILES)
    killed_run(monkeypatch, DING, "train.en", "--out-dir", out, *DING_SMALL, "--seed", "2")
    assert (out / text.SPLITS_INCOMPLETE).exists() and not text.splits_complete(out, DING_FILES)
    with pytest.raises(SystemExit) as refused:  # the classification set is not built from it
        agreement.main(["--ding-dir", str(out), "--out-dir", str(tmp_path / "sva")])
    assert refused.value.code == 2 and not (tmp_path / "sva").exists()
    run(DING, "--out-dir", out, *DING_SMALL, "--seed", "2")
    run(DING, "--out-dir", tmp_path / "fresh", *DING_SMALL, "--seed", "2")
    fresh = snapshot(tmp_path / "fresh")
    assert {name: data for name, data in snapshot(out).items() if name in fresh} == fresh
    assert sorted(os.listdir(out)) == sorted([OWNER_MARKER, "notes.txt", *DING_FILES])
    assert (out / "notes.txt").read_text() == "the user's\n"


def test_prepare_bible_killed_part_way_leaves_the_previous_splits(tmp_path, monkeypatch):
    out = tmp_path / "bible"
    run(BIBLE, "--out-dir", out, *BIBLE_SMALL)
    first = snapshot(out)
    other = ["--books", "Ruth,Romans,Jude,Genesis", "--max-train", "7", "--test-size", "5"]
    killed_run(monkeypatch, BIBLE, "test.es", "--out-dir", out, *other)
    assert snapshot(out) == first
    assert sorted(os.listdir(tmp_path)) == ["bible"]
    run(BIBLE, "--out-dir", out, *other)
    assert len((out / "train.en").read_text().splitlines()) == 7
    assert len((out / "train.es").read_text().splitlines()) == 7
