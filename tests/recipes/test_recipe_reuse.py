"""What the recipes reuse from an earlier run in the same work dir, and when they refuse to:
prepared data of another raw source or other prepare settings, a base row trained with other
settings than the row starting from it would give it, a sentencepiece model or a decoding that
a killed run left half written. And a resumed training keeps the log of its earlier sessions.

Everything runs through the driver's command line (``recipes.cli.main``); the prepare stage and
the trainings of the log test run for real on a small synthetic corpus (``--profile tiny``),
the others stand in for fairseq-train and fairseq-generate, writing what those write.
"""

import json
import os
import random
import shutil

import pytest
import torch

from local_attn_fairseq.experiments import fairseq_runner
from local_attn_fairseq.file_safety import claim_output_dir
from local_attn_fairseq.recipes import cli as recipe_cli
from local_attn_fairseq.recipes import config as rc
from local_attn_fairseq.recipes import scoring, text_preparation
from local_attn_fairseq.recipes.driver import RecipeRun
from local_attn_fairseq.recipes.workspace import WORK_DIR_OWNER

from ..conftest import kill_sentencepiece

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RECIPE, ROW = "pande_wmt14_en_de", "Baseline (a)"
DATA = "wmt14_en_de_bpe300_joint"  # the tiny profile's prepared data of RECIPE
WORDS = {
    "en": "the a house cat dog runs sleeps red green small big garden river sees".split(),
    "de": "das ein Haus Katze Hund läuft schläft rot grün klein groß Garten Fluss sieht".split(),
}


def write_raw_dir(folder, seed=1, sizes=(("train", 120), ("valid", 8), ("test", 8))):
    """A --raw-dir in the simple layout, {train,valid,test}.{en,de}: word-for-word pairs (8
    sentences at least: fairseq batches a multiple of 8 in validation)."""
    folder.mkdir()
    rng = random.Random(seed)
    for split, n in sizes:
        pairs = [[rng.randrange(len(WORDS["en"])) for _ in range(rng.randint(3, 8))]
                 for _ in range(n)]  # fmt: skip
        for lang in ("en", "de"):
            lines = (" ".join(WORDS[lang][i] for i in pair) + "\n" for pair in pairs)
            (folder / f"{split}.{lang}").write_text("".join(lines), encoding="utf-8")
    return folder


def recipe(*argv, recipe_name=RECIPE, row=ROW):
    """local-attn-recipe's main with --profile tiny: its exit status."""
    return recipe_cli.main([recipe_name, "--row", row, "--profile", "tiny", *map(str, argv)])


def one_line_error(err, *expected):
    lines = [line for line in err.splitlines() if "error" in line.lower()]
    assert "Traceback" not in err and len(lines) == 1, err
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def prepare(work_dir, raw_dir, *extra):
    return recipe("--work-dir", work_dir, "--raw-dir", raw_dir, "--stage", "prepare", *extra)


# ---- the prepare stage: data of another raw source or other settings is not reused -----------


def test_prepare_refuses_data_of_another_raw_dir(tmp_path, capsys):
    work_dir = tmp_path / "work"
    raw_a, raw_b = write_raw_dir(tmp_path / "rawA", 1), write_raw_dir(tmp_path / "rawB", 2)
    assert prepare(work_dir, raw_a) == 0
    data = work_dir / "data" / DATA
    prepared = (data / "raw" / "train.en").read_text()
    model = (data / "spm" / "spm.joint.model").read_bytes()
    capsys.readouterr()

    assert prepare(work_dir, raw_b) == 2
    one_line_error(capsys.readouterr().err, "error: ", str(data), f"raw source: {raw_a} then, "
                   f"{raw_b} now", "another --work-dir", "move that folder away")  # fmt: skip
    assert (data / "raw" / "train.en").read_text() == prepared == (raw_a / "train.en").read_text()
    assert (data / "spm" / "spm.joint.model").read_bytes() == model
    assert os.listdir(work_dir / "data") == [DATA]

    # the same files elsewhere (copied with their times) are the same source; a changed one not
    raw_copy = tmp_path / "copy_of_rawA"
    shutil.copytree(raw_a, raw_copy)
    assert prepare(work_dir, raw_copy) == 0
    with open(raw_a / "train.en", "a", encoding="utf-8") as f:
        f.write("the red cat\n")
    with open(raw_a / "train.de", "a", encoding="utf-8") as f:
        f.write("die rote Katze\n")
    capsys.readouterr()
    assert prepare(work_dir, raw_a) == 2
    one_line_error(capsys.readouterr().err, "train.de, train.en changed")
    # the train stage with a --raw-dir checks it too (its data is what it trains on)
    assert recipe("--work-dir", work_dir, "--raw-dir", raw_b, "--stage", "train") == 2
    one_line_error(capsys.readouterr().err, f"{raw_a} then, {raw_b} now")


def test_prepare_with_another_sentencepiece_sample_prepares_other_data(tmp_path, capsys):
    work_dir, raw = tmp_path / "work", write_raw_dir(tmp_path / "raw")
    assert prepare(work_dir, raw) == 0
    model = work_dir / "data" / DATA / "spm" / "spm.joint.model"
    before = (model.read_bytes(), os.stat(model).st_mtime_ns)
    assert prepare(work_dir, raw, "--override", "prepare.spm_sentences=101") == 0
    assert (model.read_bytes(), os.stat(model).st_mtime_ns) == before
    other = work_dir / "data" / f"{DATA}_spm-sentences101"
    record = json.loads((other / "prepare.json").read_text())
    assert record["settings"]["spm_sentences"] == 101
    assert (other / "spm" / "spm.joint.model").exists() and (other / "bin").is_dir()
    # sentencepiece samples more than 100 lines: a smaller sample is named before any work
    capsys.readouterr()
    assert prepare(work_dir, raw, "--override", "prepare.spm_sentences=50") == 2
    one_line_error(capsys.readouterr().err, "error: prepare.spm_sentences 50", "at least 101")


def test_prepare_refuses_a_record_with_other_settings(tmp_path, capsys):
    """Data whose record names other settings than its folder's name (a folder renamed by
    hand, or prepared before spm_sentences was in the name) is not reused."""
    work_dir, raw = tmp_path / "work", write_raw_dir(tmp_path / "raw")
    assert prepare(work_dir, raw) == 0
    record_path = work_dir / "data" / DATA / "prepare.json"
    record = json.loads(record_path.read_text())
    record["settings"]["spm_sentences"] = 1000
    record_path.write_text(json.dumps(record))
    capsys.readouterr()
    assert prepare(work_dir, raw) == 2
    one_line_error(capsys.readouterr().err, "prepare.spm_sentences: 1000 then, 10000000 now")


def test_prepare_refuses_data_without_a_record(tmp_path, capsys):
    work_dir, raw = tmp_path / "work", write_raw_dir(tmp_path / "raw")
    assert prepare(work_dir, raw) == 0
    (work_dir / "data" / DATA / "prepare.json").unlink()
    capsys.readouterr()
    assert prepare(work_dir, raw) == 2
    one_line_error(capsys.readouterr().err, "without a record of its raw source", "move")


def test_an_interrupted_sentencepiece_training_is_not_reused(tmp_path, monkeypatch):
    import sentencepiece

    work_dir, raw = tmp_path / "work", write_raw_dir(tmp_path / "raw")

    with monkeypatch.context() as killed:
        kill_sentencepiece(killed)
        with pytest.raises(KeyboardInterrupt):
            prepare(work_dir, raw)
    spm_dir = work_dir / "data" / DATA / "spm"
    assert sorted(os.listdir(spm_dir)) == []  # neither a model nor its half
    assert prepare(work_dir, raw) == 0
    model = sentencepiece.SentencePieceProcessor(model_file=str(spm_dir / "spm.joint.model"))
    assert model.get_piece_size() > 10 and (spm_dir / "spm.joint.vocab").exists()


# ---- a row that starts from another row's result ----------------------------------------------

VOITA, BASE = "voita_wmt_en_ru", "baseline 48/48/48"
GATED, PRUNED = "sparse heads 14/31/30 (from trained)", "sparse heads 14/31/30 (from scratch)"


@pytest.fixture
def fairseq_stand_ins(monkeypatch):
    """fairseq-train writes a checkpoint into its --save-dir (and the heads a pruned row kept);
    returns the commands run, [(tool, argv)]."""
    runs = []

    def run_in_process(tool, argv, log_path):
        argv = [str(a) for a in argv]
        runs.append((tool, argv))
        assert tool == "fairseq-train", f"no stand-in for {tool}"
        save_dir = argv[argv.index("--save-dir") + 1]
        os.makedirs(save_dir, exist_ok=True)
        weights = {"model": {"w": torch.ones(10)}, "cfg": {}}
        torch.save(weights, os.path.join(save_dir, "checkpoint_1_1.pt"))

    monkeypatch.setattr(fairseq_runner, "run_in_process", run_in_process)
    return runs


def voita(work_dir, row, *argv):
    return recipe("--work-dir", work_dir, "--gpus", 1, *argv, recipe_name=VOITA, row=row)


def test_a_row_is_not_started_from_a_row_trained_with_other_settings(
    tmp_path, fairseq_stand_ins, capsys
):
    work_dir = tmp_path / "work"
    claim_output_dir(str(work_dir), WORK_DIR_OWNER)
    run = RecipeRun(rc.with_settings(rc.load_recipe(VOITA), "tiny"), str(work_dir))
    os.makedirs(run.bin)  # as far as the train stage looks, the data is prepared
    assert voita(work_dir, BASE, "--stage", "train") == 0
    assert voita(work_dir, BASE, "--stage", "average") == 0
    base_model = run.averaged(BASE)
    capsys.readouterr()

    # the override would train the base row otherwise: its averaged model is not the start
    assert voita(work_dir, GATED, "--stage", "train", "--override", "dropout=0.3") == 2
    one_line_error(capsys.readouterr().err, f"row {GATED!r} starts from row {BASE!r}, which was "
                   "trained in this --work-dir with other settings", "dropout: 0.1 then, 0.3 now",
                   "another --work-dir")  # fmt: skip
    assert len(fairseq_stand_ins) == 1 and not os.path.exists(run.row_dir(GATED))

    # the settings the base row was trained with: it is reused, not trained again
    assert voita(work_dir, GATED, "--stage", "train") == 0
    (tool, argv), = fairseq_stand_ins[1:]
    assert argv[argv.index("--finetune-from-model") + 1] == base_model
    assert run.row_dir(GATED) in argv[argv.index("--save-dir") + 1]

    # further down a chain: the pruned shape starts from the gated row (and it from the base)
    os.makedirs(run.row_dir(GATED), exist_ok=True)
    with open(run.heads_kept(GATED), "w") as f:
        json.dump({"encoder_self": [[0, 1]] * 6}, f)
    capsys.readouterr()
    assert voita(work_dir, PRUNED, "--stage", "train", "--override", "l0-lambda=0.5") == 2
    one_line_error(capsys.readouterr().err, f"row {PRUNED!r} starts from row {GATED!r}",
                   "l0-lambda: 0.01 then, 0.5 now")  # fmt: skip
    assert len(fairseq_stand_ins) == 2


# ---- a killed decoding leaves no output under the name of a finished one ---------------------


def test_an_interrupted_decoding_leaves_no_generate_output(tmp_path, monkeypatch, capsys):
    work_dir = tmp_path / "work"
    claim_output_dir(str(work_dir), WORK_DIR_OWNER)
    run = RecipeRun(rc.with_settings(rc.load_recipe(RECIPE), "tiny"), str(work_dir))
    os.makedirs(run.bin)
    os.makedirs(os.path.join(run.data, "raw"))
    references = ["das ist ein Satz", "und noch einer"]
    with open(os.path.join(run.data, "raw", "test.de"), "w", encoding="utf-8") as f:
        f.write("\n".join(references) + "\n")
    os.makedirs(run.row_dir(ROW))
    torch.save({"model": {"w": torch.ones(10)}, "cfg": {}}, run.averaged(ROW))
    killed = [True]

    def generate(tool, argv, log_path):
        argv = [str(a) for a in argv]
        out_dir = argv[argv.index("--results-path") + 1]
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "generate-test.txt"), "w", encoding="utf-8") as f:
            for i, line in enumerate(references):
                f.write(f"T-{i}\t{line}\nH-{i}\t-0.1\t{line}\nD-{i}\t-0.1\t{line}\n")
                if killed[0]:
                    raise KeyboardInterrupt  # after the first sentence

    monkeypatch.setattr(fairseq_runner, "run_in_process", generate)
    with pytest.raises(KeyboardInterrupt):
        recipe("--work-dir", work_dir, "--stage", "evaluate")
    output = os.path.join(run.row_dir(ROW), "generate-test", "generate-test.txt")
    assert not os.path.exists(output)
    killed[0] = False
    assert recipe("--work-dir", work_dir, "--stage", "evaluate") == 0
    with open(output, encoding="utf-8") as f:
        decoded = f.read()
    assert "H-0\t" in decoded and "H-1\t" in decoded
    assert sorted(os.listdir(run.row_dir(ROW))) == [
        "averaged.pt", "generate-test", "results.json"]  # fmt: skip


# ---- a resumed training keeps its log ----------------------------------------------------------


def test_a_resumed_training_keeps_the_log_of_its_earlier_sessions(tmp_path):
    work_dir, raw = tmp_path / "work", write_raw_dir(tmp_path / "raw")
    common = ["--work-dir", work_dir, "--raw-dir", raw, "--gpus", 1]
    assert recipe(*common, "--stage", "prepare") == 0
    row_dir = work_dir / "rows" / RECIPE / rc.slug(ROW) / "seed1"
    log = row_dir / "train.log"
    log.parent.mkdir(parents=True)
    log.write_text("an earlier session, killed before its end\n")
    assert recipe(*common, "--stage", "train") == 0
    both = log.read_text()
    assert both.startswith("an earlier session, killed before its end\n==== new session: ")
    assert "done training" in both


def test_a_finished_training_is_not_trained_again(tmp_path, capsys):
    """fairseq-train resumed from a checkpoint at its cap takes one more update: a second
    train stage of a finished row leaves its model as it was."""
    work_dir, raw = tmp_path / "work", write_raw_dir(tmp_path / "raw")
    common = ["--work-dir", work_dir, "--raw-dir", raw, "--gpus", 1]
    assert recipe(*common, "--stage", "prepare") == 0
    assert recipe(*common, "--stage", "train") == 0
    row_dir = work_dir / "rows" / RECIPE / rc.slug(ROW) / "seed1"
    checkpoint = row_dir / "checkpoints" / "checkpoint_last.pt"
    trained, log = checkpoint.read_bytes(), (row_dir / "train.log").read_text()
    capsys.readouterr()
    assert recipe(*common, "--stage", "train") == 0
    assert "not trained again" in capsys.readouterr().out
    assert checkpoint.read_bytes() == trained and (row_dir / "train.log").read_text() == log


def test_training_speed_is_read_over_every_session_of_the_training():
    def epoch(n, updates, ups, wps=100.0):
        return (f"x | INFO | train | epoch {n:03d} | loss 8.9 | wps {wps} | ups {ups} | "
                f"num_updates {updates} | lr 2.7e-07 | train_wall 3 | wall 9\n")  # fmt: skip

    log = (
        "x | INFO | fairseq.trainer | No existing checkpoint found /c/checkpoint_last.pt\n"
        + epoch(1, 40, 10.0)  # a training whose checkpoints were removed: not this one's
        + "==== new session: 2026-01-01 10:00:00 ====\n"
        + "x | INFO | fairseq_cli.train | num. shared model params: 1,234 (num. trained: 1)\n"
        + "x | INFO | fairseq.trainer | No existing checkpoint found /c/checkpoint_last.pt\n"
        + epoch(1, 100, 2.0)
        + "==== new session: 2026-01-01 11:00:00 ====\n"  # stopped in epoch 2, resumed
        + "x | INFO | fairseq.trainer | Loaded checkpoint /c/checkpoint_last.pt "
        "(epoch 2 @ 150 updates)\n"
        + epoch(2, 200, 4.0)
        + epoch(3, 300, 1.0)
    )
    summary = scoring.training_summary(log)
    # 300 updates in 100 / 2 + 100 / 4 + 100 / 1 = 175 seconds
    assert summary == {"params": 1234, "updates_per_s": 1.71, "words_per_s": 100.0}
