import os
import subprocess
import sys

import pytest

from local_attn_fairseq.data import ding as prepare_ding

from ..conftest import REPO, run_script


LINES = [
    "# Version :: devel\n",
    "Haus {n} | Das Haus ist alt. [ugs.] | Häuser {pl} :: house | The house is old. | houses\n",
    "gehen {vi} | Wir gehen nach Hause.; Wir gehen heim. :: to go | We are going home.; We go home.\n",
    "Er kommt <kommt> morgen {adv} zurück. :: He is coming back tomorrow.\n",
    "a | Das Haus ist alt. :: b | The house is old.\n",  # duplicate pair
    "x | Zu kurz. :: y | Too short.\n",  # fewer than 4 words
    "p | Ein Satz hier. | mehr :: q | A sentence here.\n",  # misaligned parts
    "kein satz ohne punkt hier :: not a sentence without a stop here\n",
]


def test_extract_pairs_cleans_aligns_and_deduplicates():
    pairs = list(prepare_ding.extract_pairs(LINES))
    assert pairs == [
        ("Das Haus ist alt.", "The house is old."),
        ("Wir gehen nach Hause.", "We are going home."),
        ("Er kommt morgen zurück.", "He is coming back tomorrow."),
    ]


def test_split_is_seeded_and_disjoint():
    pairs = [(f"Satz Nummer {i} hier.", f"Sentence number {i} here.") for i in range(50)]
    a = prepare_ding.split_pairs(pairs, 10, 5, seed=1)
    b = prepare_ding.split_pairs(pairs, 10, 5, seed=1)
    assert a == b and [len(a[k]) for k in ("test", "valid", "train")] == [10, 5, 35]
    assert not set(a["test"]) & set(a["train"])
    with pytest.raises(ValueError, match="not enough"):
        prepare_ding.split_pairs(pairs[:12], 10, 5, seed=1)


SCRIPT = os.path.join("scripts", "prepare_ding.py")


def test_real_dictionary_gives_the_documented_corpus(tmp_path):
    """As a user runs it, a process of its own; the other runs of the script are in this one."""
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, SCRIPT), "--out-dir", tmp_path],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "18135 sentence pairs (test 1000, valid 500, train 16635)" in out
    for split, n in (("test", 1000), ("valid", 500), ("train", 16635)):
        for lang in ("de", "en"):
            assert len((tmp_path / f"{split}.{lang}").read_text().splitlines()) == n


def test_missing_dictionary_is_a_clear_error(tmp_path):
    proc = run_script(SCRIPT, "--source", tmp_path / "nope", "--out-dir", tmp_path / "out")
    assert proc.returncode != 0 and "apt-get install trans-de-en" in proc.stderr


SMALL = ["--test-size", "3", "--valid-size", "2", "--max-train", "5"]


def prepare(*argv, umask=None):
    """scripts/prepare_ding.py as a user runs it (in this process; with `umask` set, if given)."""
    previous = os.umask(umask) if umask is not None else None
    try:
        return run_script(SCRIPT, *argv)
    finally:
        if previous is not None:
            os.umask(previous)


def refused(capsys, *argv):
    """(exit status, stderr) of prepare_ding's main, run in this process (no import cost)."""
    with pytest.raises(SystemExit) as exit_info:
        prepare_ding.main([*map(str, argv)])
    return exit_info.value.code, capsys.readouterr().err


def test_prepare_ding_refuses_a_folder_it_did_not_create(tmp_path, capsys):
    (tmp_path / "train.de").write_text("a user's own file\n")
    proc = prepare("--out-dir", tmp_path, *SMALL)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "not created by scripts/prepare_ding.py" in proc.stderr and "--overwrite" in proc.stderr
    assert os.listdir(tmp_path) == ["train.de"]
    assert (tmp_path / "train.de").read_text() == "a user's own file\n"
    # --overwrite writes into it (the same option as prepare_bible.py), deleting nothing else
    (tmp_path / "notes.txt").write_text("kept")
    prepare_ding.main(["--out-dir", str(tmp_path), *SMALL, "--overwrite"])
    assert len((tmp_path / "train.de").read_text().splitlines()) == 5
    assert (tmp_path / "notes.txt").read_text() == "kept"
    # a folder it created is its own: a second run replaces its splits without --overwrite
    ours = tmp_path / "ours"
    prepare_ding.main(["--out-dir", str(ours), *SMALL])
    prepare_ding.main(["--out-dir", str(ours), "--test-size", "4", "--valid-size", "2"])
    assert len((ours / "test.en").read_text().splitlines()) == 4
    assert "/ours" in capsys.readouterr().out
    # a run killed mid-write leaves a temporary file; the next run in its folder removes it
    (ours / ".train.de.0a1b2c3d.tmp").write_text("half a split")
    prepare_ding.main(["--out-dir", str(ours), *SMALL])
    assert not [name for name in os.listdir(ours) if name.endswith(".tmp")]
    # ... but not in someone else's folder that it writes into under --overwrite
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / ".train.de.0a1b2c3d.tmp").write_text("not its to delete")
    prepare_ding.main(["--out-dir", str(theirs), *SMALL, "--overwrite"])
    assert (theirs / ".train.de.0a1b2c3d.tmp").read_text() == "not its to delete"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--test-size", "-5"], "argument --test-size: must be at least 1, got -5"),
        (["--valid-size", "0"], "argument --valid-size: must be at least 1, got 0"),
        (["--max-train", "-10"], "argument --max-train: must be at least 1, got -10"),
        (["--max-train", "0"], "argument --max-train: must be at least 1, got 0"),
        (["--min-words", "0"], "argument --min-words: must be at least 1, got 0"),
        (["--test-size", "18000", "--valid-size", "135"], "--test-size 18000 + --valid-size 135"),
        (["--min-words", "40"], "leave no training pairs"),
    ],
)
def test_prepare_ding_refuses_sizes_that_leave_a_split_empty_or_overlapping(
    tmp_path, capsys, argv, message
):
    status, err = refused(capsys, "--out-dir", tmp_path / "out", *argv)
    assert status == 2 and message in err.splitlines()[-1], err
    assert os.listdir(tmp_path) == []


def test_prepare_ding_refuses_sizes_through_the_script(tmp_path):
    proc = prepare("--out-dir", tmp_path / "out", "--test-size", "18000", "--valid-size", "500")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--test-size 18000 + --valid-size 500 leave no training pairs" in proc.stderr
    assert os.listdir(tmp_path) == []


def file_modes(folder):
    return {name: os.stat(folder / name).st_mode & 0o777 for name in os.listdir(folder)}


def test_prepare_ding_files_get_the_mode_of_the_users_umask(tmp_path):
    proc = prepare("--out-dir", tmp_path / "private", *SMALL, umask=0o077)
    assert proc.returncode == 0, proc.stderr[-2000:]
    modes = file_modes(tmp_path / "private")
    assert len(modes) == 7 and set(modes.values()) == {0o600}  # six splits and the marker
    previous = os.umask(0o022)  # a group sharing the folder reads what the tool wrote
    try:
        prepare_ding.main(["--out-dir", str(tmp_path / "shared"), *SMALL])
    finally:
        os.umask(previous)
    modes = file_modes(tmp_path / "shared")
    assert len(modes) == 7 and set(modes.values()) == {0o644}


def test_prepare_ding_reports_an_unwritable_out_dir_in_one_line(tmp_path):
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "out"  # under a regular file: not writable, even for root
    proc = prepare("--out-dir", out, *SMALL)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == f"error: --out-dir: {out}: Not a directory"
    assert os.listdir(tmp_path) == ["a_file"]
