import os

import pytest

from local_attn_fairseq.file_safety import (
    OWNER_MARKER,
    atomic_output,
    FolderNotOwned,
    atomic_write_text,
    check_output_dir,
    claim_output_dir,
    exit_on_os_error,
    refuse_same_file,
    remove_leftover_temporaries,
    staged_dir,
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


def test_only_the_temporary_files_of_atomic_output_are_leftovers(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with atomic_output(str(tmp_path / "checkpoint_3.pt")) as temporary:
            killed = temporary  # a kill: the body never finishes ...
            raise KeyboardInterrupt
    assert not os.path.exists(killed)  # ... and an exception removes its file; SIGKILL does not
    leftovers = [".checkpoint_3.pt.0123abcd.tmp", ".train.de.89ef0123.tmp"]
    kept = [".train.de.tmp", ".x.0123ABCD.tmp", "a.0123abcd.tmp", ".train.de.0123abcd.tmp.1"]
    for name in leftovers + kept:
        (tmp_path / name).write_text("")
    removed = remove_leftover_temporaries(str(tmp_path), "checkpoint*.pt")
    assert removed == [str(tmp_path / ".checkpoint_3.pt.0123abcd.tmp")]
    assert remove_leftover_temporaries(str(tmp_path)) == [str(tmp_path / leftovers[1])]
    assert sorted(os.listdir(tmp_path)) == sorted(kept)
    assert remove_leftover_temporaries(str(tmp_path / "absent")) == []


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


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_output_gives_the_mode_of_the_users_umask(tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        atomic_write_text(str(tmp_path / "new.txt"), "new")
        (tmp_path / "old.txt").write_text("old")
        os.chmod(tmp_path / "old.txt", 0o600)  # a replaced file gets a new file's mode too
        atomic_write_text(str(tmp_path / "old.txt"), "replaced")
    finally:
        os.umask(previous)
    for name in ("new.txt", "old.txt"):
        assert os.stat(tmp_path / name).st_mode & 0o777 == mode


def test_claim_output_dir_refusal_is_a_folder_not_owned_error(tmp_path):
    (tmp_path / "data.txt").write_text("a user's")
    with pytest.raises(FolderNotOwned):
        check_output_dir(str(tmp_path), "tool")
    check_output_dir(str(tmp_path / "absent"), "tool")  # nothing to refuse, nothing created
    assert os.listdir(tmp_path) == ["data.txt"]


def test_exit_on_os_error_names_the_option_the_path_and_the_problem(tmp_path):
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "out"
    with pytest.raises(SystemExit) as exit_info:
        with exit_on_os_error("--out-dir"):
            claim_output_dir(str(out), "tool")
    assert exit_info.value.code == f"error: --out-dir: {out}: Not a directory"
    with pytest.raises(SystemExit) as exit_info:
        with exit_on_os_error("--out-dir"):
            claim_output_dir(str(tmp_path), "tool")
    assert "is not empty and was not created by tool" in exit_info.value.code


def test_staged_dir_replaces_a_folder_whole_or_not_at_all(tmp_path):
    folder = str(tmp_path / "data")
    with staged_dir(folder, "tool") as staging:
        assert os.listdir(staging) == [OWNER_MARKER] and not os.path.exists(folder)
        (tmp_path / "data.partial" / "a.txt").write_text("first\n")
    assert sorted(os.listdir(folder)) == [OWNER_MARKER, "a.txt"]
    assert sorted(os.listdir(tmp_path)) == ["data"]

    # a failed build leaves the previous folder as it was and no staging folder
    with pytest.raises(RuntimeError):
        with staged_dir(folder, "tool") as staging:
            (tmp_path / "data.partial" / "b.txt").write_text("half\n")
            raise RuntimeError("killed")
    assert sorted(os.listdir(folder)) == [OWNER_MARKER, "a.txt"]
    assert sorted(os.listdir(tmp_path)) == ["data"]

    # a staging folder and a swapped-out folder that a killed run left are ours: cleared
    os.makedirs(tmp_path / "data.replaced")
    (tmp_path / "data.replaced" / OWNER_MARKER).write_text("tool\n")
    with staged_dir(folder, "tool") as staging:
        (tmp_path / "data.partial" / "b.txt").write_text("second\n")
    assert sorted(os.listdir(folder)) == [OWNER_MARKER, "b.txt"]  # not a mixture of both runs
    assert sorted(os.listdir(tmp_path)) == ["data"]


def test_staged_dir_refuses_a_folder_of_someone_else(tmp_path):
    mine = tmp_path / "data"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    with pytest.raises(FolderNotOwned):
        with staged_dir(str(mine), "tool"):
            raise AssertionError("the block must not run")
    assert os.listdir(mine) == ["notes.txt"] and sorted(os.listdir(tmp_path)) == ["data"]
    other = tmp_path / "data2.partial"
    other.mkdir()
    (other / "notes.txt").write_text("mine\n")
    with pytest.raises(FolderNotOwned):
        with staged_dir(str(tmp_path / "data2"), "tool"):
            raise AssertionError("the block must not run")
    assert os.listdir(other) == ["notes.txt"]
