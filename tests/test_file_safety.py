import os

import pytest

from local_attn_fairseq.file_safety import (
    OWNER_MARKER,
    atomic_output,
    atomic_write_text,
    claim_output_dir,
    refuse_same_file,
)


def test_atomic_output_replaces_only_on_success(tmp_path):
    target = tmp_path / "model.pt"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_output(str(target)) as temporary:
            with open(temporary, "w") as out:
                out.write("half")
            raise RuntimeError("killed mid-write")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["model.pt"]  # no temporary left behind

    atomic_write_text(str(target), "new")
    assert target.read_text() == "new"
    assert os.listdir(tmp_path) == ["model.pt"]


def test_refuse_same_file_sees_links(tmp_path):
    original = tmp_path / "a.pt"
    original.write_text("x")
    link = tmp_path / "b.pt"
    os.symlink(original, link)
    with pytest.raises(ValueError, match="is the input file"):
        refuse_same_file(str(original), str(original))
    with pytest.raises(ValueError, match="is the input file"):
        refuse_same_file(str(original), str(link))
    refuse_same_file(str(original), str(tmp_path / "c.pt"))


def test_claim_output_dir_refuses_foreign_folders(tmp_path):
    users = tmp_path / "mustc"
    users.mkdir()
    (users / "train").mkdir()
    with pytest.raises(FileExistsError, match="--overwrite"):
        claim_output_dir(str(users), "synthesize_speech_corpus")
    assert os.listdir(users) == ["train"]

    claim_output_dir(str(users), "synthesize_speech_corpus", overwrite=True)
    assert sorted(os.listdir(users)) == sorted(["train", OWNER_MARKER])

    ours = tmp_path / "new"
    claim_output_dir(str(ours), "demo")
    (ours / "log.txt").write_text("run")
    claim_output_dir(str(ours), "demo")  # its own folder is reused
    with pytest.raises(FileExistsError, match="created by demo"):
        claim_output_dir(str(ours), "study")
