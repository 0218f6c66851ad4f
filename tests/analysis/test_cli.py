"""``local-attn-analyze`` as a user meets its failures: every expected one is a line on stderr
(the file or option and what to do), exit status 2, no traceback; and an output folder that
the tool did not create is not written into without ``--overwrite``."""

import shutil

import pytest
from fairseq.data import indexed_dataset

from .conftest import analyze


def assert_one_line_error(proc, *expected):
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("local-attn-analyze"), proc.stderr[-2000:]
    for text in expected:
        assert text in errors[0]


def test_an_empty_data_folder_is_named(trained_checkpoint, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = analyze("windows", "--path", trained_checkpoint, "--data", empty,
                   "--output-dir", tmp_path / "out", "--cpu", check=False)  # fmt: skip
    assert_one_line_error(proc, "--data", str(empty), "is empty")
    assert not (tmp_path / "out").exists()  # a failed run leaves no folder behind


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 half a checkpoint"])
def test_an_unreadable_checkpoint_is_named(tmp_path, tiny_data, content):
    broken = tmp_path / "broken.pt"
    broken.write_bytes(content)
    proc = analyze("heads", "--path", broken, "--data", tiny_data / "bin",
                   "--output-dir", tmp_path / "out", check=False)  # fmt: skip
    assert_one_line_error(proc, str(broken), "truncated or not a checkpoint")


def test_contributions_of_a_post_ln_model_is_one_line(trained_checkpoint, tiny_data, tmp_path):
    proc = analyze("contributions", "--path", trained_checkpoint, "--data", tiny_data / "bin",
                   "--gen-subset", "valid", "--output-dir", tmp_path / "out", "--cpu",
                   check=False)  # fmt: skip
    assert_one_line_error(proc, str(trained_checkpoint), "post-LN", "--encoder-normalize-before")


def test_a_folder_of_someone_else_is_not_written_into(window_checkpoint, tiny_data, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "windows.json").write_text("the user's own")
    options = ["windows", "--path", window_checkpoint, "--data", tiny_data / "bin",
               "--gen-subset", "valid", "--max-sentences", 1, "--output-dir", out, "--cpu"]
    proc = analyze(*options, check=False, separate_process=True)  # the installed script
    assert_one_line_error(proc, "--output-dir", str(out), "--overwrite")
    assert sorted(p.name for p in out.iterdir()) == ["windows.json"]
    assert (out / "windows.json").read_text() == "the user's own"

    analyze(*options, "--overwrite")  # the user says so: written
    assert (out / "windows.json").read_text() != "the user's own"
    assert (out / "windows_dynamic.png").exists()
    # from now on the folder is the tool's own: a second run needs no option
    analyze(*options)


@pytest.fixture
def empty_subset(tiny_data, tmp_path):
    """The tiny corpus's dictionaries with a binarised subset ``empty`` of no sentence (in
    fairseq's lazy format: its default, mmap, cannot map the empty data file at all)."""
    data = tmp_path / "data"
    data.mkdir()
    for lang in ("de", "en"):
        shutil.copy(tiny_data / "bin" / f"dict.{lang}.txt", data)
        prefix = str(data / f"empty.de-en.{lang}")
        indexed_dataset.make_builder(prefix + ".bin", impl="lazy").finalize(prefix + ".idx")
    return data


@pytest.mark.parametrize("subcommand", ["windows", "heads", "bias", "sensitivity", "contributions"])
def test_an_empty_subset_is_named(
    subcommand, empty_subset, window_checkpoint, translation_checkpoint, tmp_path
):
    # taken as given, it makes a report of no sentence, or a failure later in other words
    checkpoint = translation_checkpoint if subcommand == "contributions" else window_checkpoint
    proc = analyze(subcommand, "--path", checkpoint, "--data", empty_subset, "--gen-subset",
                   "empty", "--output-dir", tmp_path / "out", "--cpu", check=False)  # fmt: skip
    assert_one_line_error(proc, "subset 'empty' holds no sentences")
    assert not (tmp_path / "out").exists()
