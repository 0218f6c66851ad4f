"""``local-attn-analyze`` outputs and inputs: a run's files land in --output-dir all together or
not at all (never a JSON beside figures of another run, never a stale figure of an earlier run
of the same subcommand), option values outside their range are refused with the option's name,
and a text file that is not UTF-8 is named with its line, for every subcommand."""

import json
import shutil

import pytest

from local_attn_fairseq.analysis import attention_bias_cli, cli, learned_windows_cli, output
from local_attn_fairseq.file_safety import OWNER_MARKER

from ..speech_data import asr_checkpoint
from .conftest import SOURCE_LINES

BIAS_FILES = ["bias.json", "bias_heads.png", "bias_thresholds.png"]


def analyse(*argv):
    return cli.main([str(a) for a in argv])


def one_error_line(capsys, *expected):
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    for text in expected:
        assert text in errors[0], err
    return errors[0]


def contents(folder, names):
    return {name: (folder / name).read_bytes() for name in names}


def results(folder):
    """The visible files of an output folder (hidden staging and bookkeeping files left out)."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def checkpoint_copy(checkpoint, folder):
    """The same model under another path, so that the JSON of each run names its own."""
    folder.mkdir()
    return shutil.copy(checkpoint, folder / "checkpoint_last.pt")


def bias_run(checkpoint, tiny_data, out, sentences):
    return analyse("bias", "--path", checkpoint, "--data", tiny_data / "bin", "--max-sentences",
                   sentences, "--output-dir", out, "--cpu")  # fmt: skip


# -- finding 4: a run's files are complete or absent ------------------------------------------
def test_a_bias_run_dying_after_its_json_leaves_the_previous_set_whole(
    trained_checkpoint, tiny_data, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "an4"
    assert bias_run(trained_checkpoint, tiny_data, out, 1) == 0
    first = contents(out, BIAS_FILES)
    other = checkpoint_copy(trained_checkpoint, tmp_path / "other")

    def killed(*args):
        raise KeyboardInterrupt  # after bias.json and bias_thresholds.png were written

    monkeypatch.setattr(attention_bias_cli, "plot_head_map", killed)
    with pytest.raises(KeyboardInterrupt):
        bias_run(other, tiny_data, out, 2)
    assert results(out) == BIAS_FILES
    assert contents(out, BIAS_FILES) == first  # the old JSON and the figures that match it
    assert not [p for p in out.iterdir() if p.name.startswith(output.STAGING_PREFIX)]


def test_a_bias_run_killed_while_moving_its_files_in_is_cleaned_up_by_the_next(
    trained_checkpoint, tiny_data, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "an4"
    assert bias_run(trained_checkpoint, tiny_data, out, 1) == 0
    first = contents(out, BIAS_FILES)
    other = checkpoint_copy(trained_checkpoint, tmp_path / "other")
    moved = []

    def killed_after_one(source, destination):
        if moved:
            raise KeyboardInterrupt  # a kill: nothing of the run cleans up after it
        moved.append(destination)
        shutil.move(source, destination)

    monkeypatch.setattr(output, "_move", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        bias_run(other, tiny_data, out, 2)
    # between the old record's removal and the new one's arrival: no bias.json at all, so no
    # JSON names a checkpoint whose figures are not beside it
    assert not (out / "bias.json").exists()
    assert [p.name for p in out.iterdir() if p.name.startswith(output.STAGING_PREFIX)]

    monkeypatch.undo()
    assert bias_run(other, tiny_data, out, 2) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(
        BIAS_FILES + [OWNER_MARKER, output.MANIFEST_PREFIX + "bias"]
    )  # the killed run's staging folder is gone
    second = contents(out, BIAS_FILES)
    assert json.loads(second["bias.json"])["checkpoint"] == str(other)
    # the thresholds figure's title counts the sentences: 2 now, 1 before
    assert second["bias_thresholds.png"] != first["bias_thresholds.png"]


def staged(folder, files):
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


@pytest.mark.parametrize("kill_at", range(5))
def test_every_kill_point_of_a_commit_leaves_a_json_only_beside_its_own_files(
    tmp_path, monkeypatch, kill_at
):
    """Old run: a.json, one.png, two.png; new run: a.json, one.png (two.png is stale). Killed
    after `kill_at` file operations of the commit, the folder holds either no a.json or the
    a.json of one run with exactly that run's other files."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "user.txt").write_text("mine")
    old = {"a.json": "old", "one.png": "old", "two.png": "old"}
    output.commit_results(str(out), "sub", str(staged(out / ".stage1", old)))
    new = {"a.json": "new", "one.png": "new"}
    steps = []

    def count(step):
        def operation(*args, **kwargs):
            if len(steps) == kill_at:
                raise KeyboardInterrupt
            steps.append(step)
            return step(*args, **kwargs)

        return operation

    monkeypatch.setattr(output, "_move", count(output._move))
    monkeypatch.setattr(output, "_remove", count(output._remove))
    try:
        output.commit_results(str(out), "sub", str(staged(out / ".stage2", new)))
        killed = False
    except KeyboardInterrupt:
        killed = True
    assert killed == (kill_at < 4)  # 2 removals (old a.json, stale two.png), then 2 moves
    present = {p.name: p.read_text() for p in out.iterdir() if p.is_file()}
    assert present.pop("user.txt") == "mine"
    present.pop(OWNER_MARKER, None)
    manifest = set(output.read_manifest(str(out), "sub"))
    present.pop(output.MANIFEST_PREFIX + "sub")
    if "a.json" in present:
        run = old if present["a.json"] == "old" else new
        assert present == run
    # whatever is left, the manifest names it, so the next run can clean it up
    assert set(present) <= manifest
    monkeypatch.undo()
    output.commit_results(str(out), "sub", str(staged(out / ".stage3", new)))
    assert {p.name: p.read_text() for p in out.iterdir() if p.suffix != ".txt" and
            not p.name.startswith(".")} == new  # fmt: skip


# -- finding 5: stale figures of an earlier run of the same subcommand ------------------------
def test_windows_of_a_model_with_fewer_mechanisms_removes_the_stale_figure(
    window_checkpoint, tiny_data, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "wi1"
    common = ["--data", tiny_data / "bin", "--gen-subset", "valid", "--max-sentences", 1,
              "--output-dir", out, "--cpu"]  # fmt: skip
    assert analyse("bias", "--path", window_checkpoint, *common) == 0
    (out / "notes.txt").write_text("the user's own")
    assert analyse("windows", "--path", window_checkpoint, *common) == 0
    assert "windows_gaussian.png" in results(out) and "windows_dynamic.png" in results(out)
    bias_files = contents(out, BIAS_FILES)

    # a second model with dynamic windows only (as ck_dyn after ck_loc)
    dynamic_only = checkpoint_copy(window_checkpoint, tmp_path / "dyn")
    monkeypatch.setattr(learned_windows_cli, "gaussian_attention_modules", lambda model: {})
    assert analyse("windows", "--path", dynamic_only, *common) == 0
    assert results(out) == sorted(BIAS_FILES + ["notes.txt", "windows.json",
                                                "windows_dynamic.png"])  # fmt: skip
    assert json.loads((out / "windows.json").read_text())["checkpoint"] == str(dynamic_only)
    assert list(json.loads((out / "windows.json").read_text())["mechanisms"]) == ["dynamic"]
    # other subcommands' results and the user's file are not touched
    assert contents(out, BIAS_FILES) == bias_files
    assert (out / "notes.txt").read_text() == "the user's own"


# -- finding 6: option ranges -----------------------------------------------------------------
CONTRIBUTIONS = ["contributions", "--path", "ck.pt", "--data", "data"]
HEADS = ["heads", "--path", "ck.pt", "--data", "data"]


@pytest.mark.parametrize(
    "argv, option",
    [
        (CONTRIBUTIONS + ["--batch-size", "0"], "--batch-size"),
        (CONTRIBUTIONS + ["--batch-size", "-1"], "--batch-size"),
        (CONTRIBUTIONS + ["--num-sentences", "0"], "--num-sentences"),
        (CONTRIBUTIONS + ["--threshold", "-1"], "--threshold"),
        (CONTRIBUTIONS + ["--threshold", "1.5"], "--threshold"),
        (CONTRIBUTIONS + ["--threshold", "nan"], "--threshold"),
        (CONTRIBUTIONS + ["--max-contribution-loss", "2"], "--max-contribution-loss"),
        (CONTRIBUTIONS + ["--global-layers", "-2"], "--global-layers"),
        (CONTRIBUTIONS + ["--plot-sentence", "-1"], "--plot-sentence"),
        (HEADS + ["--positional-threshold", "1.2"], "--positional-threshold"),
        (HEADS + ["--syntactic-margin", "-0.1"], "--syntactic-margin"),
        (HEADS + ["--rare-threshold", "2"], "--rare-threshold"),
        (HEADS + ["--min-relation-queries", "0"], "--min-relation-queries"),
        (HEADS + ["--rare-top-n", "-1"], "--rare-top-n"),
        (HEADS + ["--lrp-alpha", "1.5"], "--lrp-alpha"),
    ],
)
def test_option_values_out_of_range_are_refused_by_name(argv, option, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        analyse(*argv, "--output-dir", out)
    assert exit_.value.code == 2
    one_error_line(capsys, f"argument {option}")
    assert not out.exists()


def contributions_run(tmp_path_factory, out, *extra):
    data, checkpoint = asr_checkpoint(tmp_path_factory)
    return analyse("contributions", "--path", checkpoint, "--data", data, "--config-yaml",
                   "config_asr.yaml", "--gen-subset", "dev_asr", "--num-sentences", 3,
                   "--output-dir", out, "--cpu", *extra)  # fmt: skip


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--global-layers", "99"], ["--global-layers 99", "has 6 encoder layers", "0 to 6"]),
        (["--plot-sentence", "99"], ["--plot-sentence 99", "has 3 sentences", "0 to 2"]),
    ],
)
def test_contributions_options_beyond_the_model_and_sample_are_named(
    extra, expected, tmp_path_factory, tmp_path, capsys
):
    out = tmp_path / "out"
    assert contributions_run(tmp_path_factory, out, *extra) == 2
    one_error_line(capsys, *expected)
    assert not out.exists()


# -- finding 7: text files that are not UTF-8 -------------------------------------------------
@pytest.fixture
def latin1_text(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(SOURCE_LINES[0].encode() + b"\nein Haus \xff\xfe\n")
    return path


@pytest.mark.parametrize("subcommand", ["sensitivity", "bias", "heads", "windows"])
def test_a_source_text_that_is_not_utf8_is_named_with_its_line(
    subcommand, window_checkpoint, tiny_data, latin1_text, tmp_path, capsys
):
    out = tmp_path / "an2"
    code = analyse(subcommand, "--path", window_checkpoint, "--data", tiny_data / "bin",
                   "--source-text", latin1_text, "--output-dir", out, "--cpu")  # fmt: skip
    assert code == 2
    one_error_line(capsys, "--source-text", str(latin1_text), "line 2", "not UTF-8", "0xff")
    assert not out.exists()


@pytest.mark.parametrize("option", ["--target-text", "--conllu", "--spacy-model"])
def test_other_text_inputs_that_are_not_utf8_are_named_with_their_line(
    option, window_checkpoint, tiny_data, source_text, latin1_text, tmp_path, capsys
):
    given = {
        "--target-text": ["--source-text", source_text, "--target-text", latin1_text],
        "--conllu": ["--conllu", latin1_text],
        # the raw text is read before spaCy is asked for the model
        "--spacy-model": ["--source-text", latin1_text, "--spacy-model", "de_core_news_sm"],
    }[option]
    code = analyse("bias", "--path", window_checkpoint, "--data", tiny_data / "bin", *given,
                   "--output-dir", tmp_path / "out", "--cpu")  # fmt: skip
    assert code == 2
    named = "--source-text" if option == "--spacy-model" else option
    one_error_line(capsys, named, str(latin1_text), "line 2", "not UTF-8")

