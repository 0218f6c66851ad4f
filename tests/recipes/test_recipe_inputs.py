"""What a user can get wrong on the command lines of the recipes: ``local-attn-recipe``
(``recipes.cli.main``), ``scripts/recipes/average_checkpoints.py`` (``recipes.averaging.main``)
and ``scripts/prune_heads.py`` (``prune_heads.main``). Each mistake ends in one line naming the
option or file and a non-zero exit, never a traceback, and a user's file is never replaced
unasked.

Nothing here trains: the checkpoints are small checkpoint-shaped files, and where a stage would
run fairseq-train or fairseq-generate, a stand-in writes what that tool writes (a checkpoint, a
generate output), so that the recipes' own bookkeeping runs as it does for a real run.
"""

import errno
import json
import os

import pytest
import torch

from local_attn_fairseq import prune_heads
from local_attn_fairseq.experiments import fairseq_runner
from local_attn_fairseq.file_safety import claim_output_dir
from local_attn_fairseq.recipes import averaging
from local_attn_fairseq.recipes import cli as recipe_cli
from local_attn_fairseq.recipes import config as rc
from local_attn_fairseq.recipes.driver import RecipeRun
from local_attn_fairseq.recipes.text_preparation import raw_path
from local_attn_fairseq.recipes.workspace import WORK_DIR_OWNER

RECIPE, ROW = "pande_wmt14_en_de", "Baseline (a)"


def save_checkpoint(path, value=1.0):
    """A checkpoint as fairseq-train writes it, for what averaging reads: weights and fields."""
    torch.save({"model": {"w": torch.full((1000,), value)}, "cfg": {"saved": value}}, path)


def truncate(path, size=1000):
    with open(path, "rb") as f:
        head = f.read(size)
    with open(path, "wb") as f:
        f.write(head)


def error_lines(err):
    """The lines of stderr that report an error (fairseq's import may log a line of its own)."""
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if "error" in line.lower()]


def one_line_error(err, *expected):
    lines = error_lines(err)
    assert len(lines) == 1, err
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


# ---- scripts/recipes/average_checkpoints.py --------------------------------------------------


@pytest.fixture
def save_dir(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for update, value in ((10, 1.0), (20, 3.0)):
        save_checkpoint(folder / f"checkpoint_1_{update}.pt", value)
    return folder


def average(*argv):
    """averaging.main as the script runs it: None on success, else the SystemExit."""
    try:
        return averaging.main([str(a) for a in argv])
    except SystemExit as exit:
        assert exit.code not in (0, None)
        return exit


def test_average_checkpoints_replaces_a_file_only_with_overwrite(save_dir, tmp_path, capsys):
    user_file = tmp_path / "userfile.txt"
    user_file.write_text("precious")
    exit = average(save_dir, user_file, "--last", 1)
    assert isinstance(exit, SystemExit) and "--overwrite" in str(exit.code)
    assert str(user_file) in str(exit.code) and user_file.read_text() == "precious"
    assert average(save_dir, user_file, "--last", 2, "--overwrite") is None
    averaged = torch.load(user_file, weights_only=False)
    assert torch.equal(averaged["model"]["w"], torch.full((1000,), 2.0))


def test_average_checkpoints_never_writes_over_an_input_even_with_overwrite(save_dir):
    newest = save_dir / "checkpoint_1_20.pt"
    exit = average(save_dir, newest, "--last", 2, "--overwrite")
    assert isinstance(exit, SystemExit) and "is the input file" in str(exit.code)
    assert torch.load(newest, weights_only=False)["cfg"] == {"saved": 3.0}


@pytest.mark.parametrize("where", ["under a file", "a folder"])
def test_average_checkpoints_names_an_output_path_it_cannot_write(save_dir, tmp_path, where,
                                                                   capsys):  # fmt: skip
    a_file = tmp_path / "afile"
    a_file.write_text("")
    output = a_file / "out.pt" if where == "under a file" else tmp_path
    exit = average(save_dir, output, "--last", 1)
    assert exit.code == 2  # argparse: the output argument
    one_line_error(capsys.readouterr().err, "argument output", str(output))
    assert a_file.read_text() == ""


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_average_checkpoints_names_a_checkpoint_it_cannot_read(save_dir, tmp_path, damage):
    broken = save_dir / "checkpoint_1_20.pt"
    if damage == "truncated":
        truncate(broken)
    else:
        broken.write_bytes(b"")
    exit = average(save_dir, tmp_path / "out.pt", "--last", 2)
    assert isinstance(exit, SystemExit)
    message = str(exit.code)
    assert message.startswith("error: ") and "\n" not in message
    assert str(broken) in message and "cannot be read" in message
    assert not (tmp_path / "out.pt").exists()


def test_average_checkpoints_names_last_when_it_is_not_a_count(save_dir, tmp_path, capsys):
    exit = average(save_dir, tmp_path / "out.pt", "--last", 0)
    assert exit.code == 2
    one_line_error(capsys.readouterr().err, "--last", "at least 1")


# ---- scripts/prune_heads.py ------------------------------------------------------------------


def test_prune_heads_names_an_output_under_a_regular_file(tmp_path, capsys):
    checkpoint = tmp_path / "gated.pt"
    save_checkpoint(checkpoint)
    (tmp_path / "afile").write_text("")
    output = tmp_path / "afile" / "out.pt"
    assert prune_heads.main([str(checkpoint), str(output)]) == 2
    one_line_error(capsys.readouterr().err, "prune_heads.py: error:", str(tmp_path / "afile"))


def test_prune_heads_reports_a_failed_write_in_one_line(tmp_path, capsys, monkeypatch):
    checkpoint = tmp_path / "gated.pt"
    save_checkpoint(checkpoint)
    output = tmp_path / "pruned.pt"

    def disk_full(checkpoint_in, checkpoint_out):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), checkpoint_out)

    monkeypatch.setattr(prune_heads, "prune_checkpoint", disk_full)
    assert prune_heads.main([str(checkpoint), str(output)]) == 2
    one_line_error(capsys.readouterr().err, "prune_heads.py: error: output:", str(output))


# ---- local-attn-recipe -----------------------------------------------------------------------


def recipe(*argv):
    """local-attn-recipe's main on the row ``ROW``: its exit status."""
    return recipe_cli.main([RECIPE, "--row", ROW, *map(str, argv)])


def test_recipe_names_a_work_dir_under_a_regular_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    work_dir = tmp_path / "afile" / "out"
    assert recipe("--work-dir", work_dir, "--stage", "prepare") == 2
    one_line_error(capsys.readouterr().err, "error: --work-dir", str(work_dir))


@pytest.mark.parametrize("value", ["0", "-2", "abc", "true"])
def test_recipe_refuses_an_average_count_that_is_not_one(tmp_path, value, capsys):
    # --dry-run: a negative count was printed as a command, and 0 or abc failed after training
    argv = ["--work-dir", tmp_path / "w", "--dry-run", "--override", f"average.last={value}"]
    assert recipe(*argv) == 2
    one_line_error(capsys.readouterr().err, "error: average.last", "at least 1")


def test_recipe_refuses_a_negative_seed_before_creating_anything(tmp_path, capsys):
    work_dir = tmp_path / "w"
    with pytest.raises(SystemExit) as exit:
        recipe("--work-dir", work_dir, "--seed", "-1", "--stage", "train")
    assert exit.value.code == 2
    one_line_error(capsys.readouterr().err, "--seed", "at least 0")
    assert not work_dir.exists()


@pytest.mark.parametrize("value", ["-5", "0", "abc"])
def test_recipe_refuses_a_text_vocabulary_size_that_is_not_one(tmp_path, value, capsys):
    argv = ["--work-dir", tmp_path / "w", "--override", f"prepare.vocab_size={value}"]
    assert recipe(*argv, "--dry-run") == 2
    one_line_error(capsys.readouterr().err, "error: prepare.vocab_size", "at least 1")
    # the real run is refused before it claims the work dir or reads any data
    assert recipe(*argv, "--stage", "prepare") == 2
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("localness-layers=encoder_self:2-0",
         "--localness-layers entry encoder_self:2-0: layer selector '2-0' runs backwards"),
        ("dynamic-window=encoder_self:aw:0-2 decoder_self:mw:4-1",
         "--dynamic-window entry decoder_self:mw:4-1: layer selector '4-1' runs backwards"),
        ("dynamic-window=", "--dynamic-window '' selects nothing"),
        ('head-gates=""', "--head-gates '' names no attention type"),
    ],
)  # fmt: skip
def test_recipe_refuses_an_option_that_selects_nothing_before_any_stage(
    tmp_path, override, message, capsys
):
    # fairseq-train would refuse it only once the data is prepared (a dry run printed it)
    argv = ["--work-dir", tmp_path / "w", "--override", override]
    assert recipe(*argv, "--dry-run") == 2
    one_line_error(capsys.readouterr().err, f"error: {message}")
    assert recipe(*argv, "--stage", "prepare") == 2
    assert not (tmp_path / "w").exists()


def write_raw_dir(folder, empty=(), folders=()):
    """A --raw-dir in the simple layout: {train,valid,test}.{en,de}."""
    folder.mkdir()
    for split in ("train", "valid", "test"):
        for lang in ("en", "de"):
            path = folder / f"{split}.{lang}"
            if path.name in folders:
                path.mkdir()
            else:
                path.write_text("" if path.name in empty else f"a {split} sentence\n" * 3)
    return folder


@pytest.mark.parametrize(
    "damage", [{"empty": ["test.de"]}, {"empty": ["valid.en"]}, {"folders": ["test.en"]}]
)
def test_recipe_refuses_a_raw_split_that_is_empty_or_no_file(tmp_path, damage, capsys):
    raw_dir = write_raw_dir(tmp_path / "raw", **damage)
    (name,) = damage.get("empty", []) + damage.get("folders", [])
    work_dir = tmp_path / "work"
    assert recipe("--work-dir", work_dir, "--raw-dir", raw_dir, "--stage", "prepare") == 2
    one_line_error(capsys.readouterr().err, "error: --raw-dir", str(raw_dir / name))
    # refused before any work: no split was copied, no sentencepiece model trained
    assert not (work_dir / "data").exists()


# ---- a row's folder and the settings of its checkpoints --------------------------------------


@pytest.fixture
def prepared_work_dir(tmp_path):
    """A work dir of the recipes where the prepare stage has run (as far as the train and
    evaluate stages look: the binarised data's folder and the raw test references)."""
    work_dir = tmp_path / "work"
    claim_output_dir(str(work_dir), WORK_DIR_OWNER)
    run = RecipeRun(rc.load_recipe(RECIPE), str(work_dir))
    os.makedirs(run.bin)
    os.makedirs(os.path.dirname(raw_path(run, "test", "de")))
    with open(raw_path(run, "test", "de"), "w", encoding="utf-8") as f:
        f.write("das ist ein ganz kurzer Satz\nund das ist noch ein Satz\n")
    return work_dir


def row_dir(work_dir):
    return work_dir / "rows" / RECIPE / rc.slug(ROW) / "seed1"


@pytest.fixture
def fairseq_stand_ins(monkeypatch):
    """fairseq-train writes a checkpoint into its --save-dir, fairseq-generate a perfect
    translation of the references; returns the tools run, in order."""
    runs = []

    def run_in_process(tool, argv, log_path):
        argv = [str(a) for a in argv]
        runs.append(tool)
        if tool == "fairseq-train":
            save_dir = argv[argv.index("--save-dir") + 1]
            os.makedirs(save_dir, exist_ok=True)
            number = sum(1 for t in runs if t == tool)
            save_checkpoint(os.path.join(save_dir, f"checkpoint_1_{number}.pt"), number)
        elif tool == "fairseq-generate":
            out_dir = argv[argv.index("--results-path") + 1]
            os.makedirs(out_dir, exist_ok=True)
            data = argv[0]
            with open(os.path.join(data, "..", "raw", "test.de"), encoding="utf-8") as f:
                references = f.read().splitlines()
            with open(os.path.join(out_dir, "generate-test.txt"), "w", encoding="utf-8") as f:
                for i, line in enumerate(references):
                    f.write(f"T-{i}\t{line}\nH-{i}\t-0.1\t{line}\nD-{i}\t-0.1\t{line}\n")
        else:
            raise AssertionError(f"no stand-in for {tool}")

    monkeypatch.setattr(fairseq_runner, "run_in_process", run_in_process)
    return runs


def test_a_rows_folder_keeps_the_settings_its_checkpoints_were_trained_with(
    prepared_work_dir, fairseq_stand_ins, capsys
):
    work_dir, folder = prepared_work_dir, row_dir(prepared_work_dir)
    first = ["--work-dir", work_dir, "--gpus", 1, "--override", "max-update=2"]
    assert recipe(*first, "--stage", "train") == 0
    record = json.loads((folder / "settings.json").read_text())
    assert record["settings"]["args"]["max-update"] == 2
    assert record["given"]["overrides"] == ["max-update=2"]
    assert "--max-update 2" in record["train_command"]
    # the same settings again: the run resumes in its folder
    assert recipe(*first, "--stage", "train") == 0
    assert fairseq_stand_ins == ["fairseq-train", "fairseq-train"]
    capsys.readouterr()

    changed = ["--work-dir", work_dir, "--gpus", 1]
    changed += ["--override", "max-update=1", "--override", "dropout=0.9"]
    for stage in ("train", "average", "all"):
        assert recipe(*changed, "--stage", stage) == 2
        message = one_line_error(capsys.readouterr().err, "error: ", "another --work-dir")
        assert "max-update: 2 then, 1 now" in message and "dropout: 0.1 then, 0.9 now" in message
    assert fairseq_stand_ins == ["fairseq-train", "fairseq-train"]  # nothing ran
    assert json.loads((folder / "settings.json").read_text()) == record
    assert not (folder / "averaged.pt").exists()

    assert recipe(*first, "--stage", "average") == 0
    assert recipe(*first, "--stage", "evaluate") == 0
    results = json.loads((folder / "results.json").read_text())
    assert results["given"] == {"profile": None, "overrides": ["max-update=2"]}
    assert results["settings"]["train"] == record["settings"]
    assert results["settings"]["average"]["last"] == 5 and results["measured"]["bleu"] == 100.0


def test_a_settings_record_without_checkpoints_is_replaced(prepared_work_dir, fairseq_stand_ins):
    """A run that stopped before its first save (a mistyped fairseq option) has nothing to keep:
    the corrected run starts in the same folder."""
    folder = row_dir(prepared_work_dir)
    base = ["--work-dir", prepared_work_dir, "--gpus", 1, "--stage", "train"]
    assert recipe(*base, "--override", "max-update=2") == 0
    for checkpoint in (folder / "checkpoints").iterdir():
        checkpoint.unlink()
    assert recipe(*base, "--override", "max-update=3") == 0
    record = json.loads((folder / "settings.json").read_text())
    assert record["settings"]["args"]["max-update"] == 3


def test_the_average_stage_names_a_truncated_checkpoint(prepared_work_dir, capsys):
    checkpoints = row_dir(prepared_work_dir) / "checkpoints"
    checkpoints.mkdir(parents=True)
    save_checkpoint(checkpoints / "checkpoint_1_2.pt")
    save_checkpoint(checkpoints / "checkpoint_1_3.pt")
    truncate(checkpoints / "checkpoint_1_3.pt")
    assert recipe("--work-dir", prepared_work_dir, "--stage", "average") == 2
    one_line_error(
        capsys.readouterr().err, str(checkpoints / "checkpoint_1_3.pt"), "average stage again"
    )
    assert not (row_dir(prepared_work_dir) / "averaged.pt").exists()


def test_the_evaluate_stage_names_a_truncated_averaged_model(prepared_work_dir, capsys):
    averaged = row_dir(prepared_work_dir) / "averaged.pt"
    averaged.parent.mkdir(parents=True)
    save_checkpoint(averaged)
    truncate(averaged)
    assert recipe("--work-dir", prepared_work_dir, "--stage", "evaluate") == 2
    one_line_error(capsys.readouterr().err, str(averaged), "run the average stage again")
