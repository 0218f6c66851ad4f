"""The demos' and the study's inputs: work folders they may write into, counts, lambdas, seeds and
vocabulary sizes, refused with one line before any work; and runs keyed by their data settings.

Cheap: every tool is called through its ``main(argv)`` in this process, and where a test needs a
run to go past its checks, the training and scoring steps are replaced by recorders.
"""

import os

import pytest

from local_attn_fairseq.data.text import VocabularyTooLarge, train_sentencepiece
from local_attn_fairseq.experiments import (
    demo,
    prune_demo,
    small_scale_study,
    speech_demo,
    speech_study,
)
from local_attn_fairseq.file_safety import OWNER_MARKER, claim_output_dir

from ..conftest import kill_sentencepiece

TOOLS = {
    "demo": (demo, ["--corpus", "ding-de-en"]),
    "prune_demo": (prune_demo, []),
    "speech_demo": (speech_demo, ["--quick"]),
    "small_scale_study": (small_scale_study, ["--corpus", "ding-de-en"]),
    "small_scale_study --report-only": (small_scale_study, ["--report-only"]),
    "speech_study": (speech_study, ["--tiny"]),
}


@pytest.fixture(autouse=True)
def no_demo_epochs(monkeypatch):
    monkeypatch.delenv("DEMO_EPOCHS", raising=False)


def exit_message(module, argv):
    """The message of the SystemExit that ``module.main(argv)`` ends with (one line)."""
    with pytest.raises(SystemExit) as exited:
        module.main([str(a) for a in argv])
    message = str(exited.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def argument_error(module, argv, capsys):
    """argparse's refusal (status 2) of ``argv``: its last stderr line."""
    with pytest.raises(SystemExit) as exited:
        module.parse_args([str(a) for a in argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("name", TOOLS)
def test_a_folder_the_demos_did_not_create_is_refused(tmp_path, name, monkeypatch):
    module, extra = TOOLS[name]
    monkeypatch.setattr(module, "run_demo" if hasattr(module, "run_demo") else "run_study", None)
    mine = tmp_path / "fdemo"
    mine.mkdir()
    (mine / "results.md").write_text("mine\n")
    message = exit_message(module, ["--work-dir", mine, *extra])
    assert "--work-dir" in message and "--overwrite" in message
    assert os.listdir(mine) == ["results.md"] and (mine / "results.md").read_text() == "mine\n"


@pytest.mark.parametrize("name", TOOLS)
def test_the_demos_share_their_folders_and_overwrite_writes_into_a_foreign_one(
    tmp_path, name, monkeypatch
):
    module, extra = TOOLS[name]
    step = "run_demo" if hasattr(module, "run_demo") else "run_study"
    ran = []
    monkeypatch.setattr(module, step, lambda args, *rest: ran.append(args.work_dir))
    shared = tmp_path / "demo_runs"
    claim_output_dir(str(shared), demo.WORK_DIR_OWNER)  # as another of the demos left it
    (shared / "results.md").write_text("the Ding demo's\n")
    module.main(["--work-dir", str(shared), *extra])
    foreign = tmp_path / "old_demo_runs"
    foreign.mkdir()
    (foreign / "results.md").write_text("from an earlier version\n")
    module.main(["--work-dir", str(foreign), "--overwrite", *extra])
    assert ran == [str(shared), str(foreign)]
    assert (foreign / OWNER_MARKER).read_text().strip() == demo.WORK_DIR_OWNER
    assert (foreign / "results.md").read_text() == "from an earlier version\n"  # not deleted


def test_the_speech_demos_folder_leaves_the_demos_folder_usable(tmp_path, monkeypatch):
    ran = []
    for module in (speech_demo, demo):
        monkeypatch.setattr(module, "run_demo", lambda args: ran.append(args.work_dir))
    speech_demo.main(["--work-dir", str(tmp_path / "demo_runs" / "speech")])
    demo.main(["--work-dir", str(tmp_path / "demo_runs")])  # not refused: speech/ is the demos'
    assert ran == [str(tmp_path / "demo_runs" / "speech"), str(tmp_path / "demo_runs")]


@pytest.mark.parametrize("name", TOOLS)
def test_a_work_dir_under_a_regular_file_is_one_line(tmp_path, name):
    module, extra = TOOLS[name]
    afile = tmp_path / "afile"
    afile.write_text("")
    message = exit_message(module, ["--work-dir", afile / "out", *extra])
    assert message.startswith("error: --work-dir: ") and str(afile / "out") in message


class Recorder:
    """Stands in for training and scoring: records each job's --save-dir and each scored path."""

    def __init__(self, monkeypatch, test_lines=3):
        self.saved, self.scored = [], []
        self.test_lines = test_lines
        monkeypatch.setattr(demo, "prepare_data", self.prepare_data)
        monkeypatch.setattr(demo, "train_side_by_side", self.train)
        monkeypatch.setattr(demo, "bleu", self.bleu)
        monkeypatch.setattr(demo, "encoder_attention_parameters", lambda checkpoint: 1000)
        monkeypatch.setattr(demo, "words_per_second", lambda log: 1.0)

    def prepare_data(self, data_dir, corpus, vocab_size, max_train=None, test_size=None):
        raw = os.path.join(data_dir, "raw")
        os.makedirs(raw, exist_ok=True)
        for lang in ("de", "en", "es"):
            with open(os.path.join(raw, f"test.{lang}"), "w") as f:
                f.write("a sentence\n" * self.test_lines)
        return os.path.join(data_dir, "bin")

    def train(self, jobs, parallel=None):
        self.saved += [job.command[job.command.index("--save-dir") + 1] for job in jobs]

    def bleu(self, bin_dir, checkpoint, out_path, in_process=False):
        self.scored.append(out_path)
        return 1.0


def test_demo_models_and_scores_are_keyed_by_the_data_settings(tmp_path, monkeypatch):
    runs = Recorder(monkeypatch)
    work = tmp_path / "demo"
    common = ["--work-dir", str(work), "--corpus", "ding-de-en", "--epochs", "1"]
    demo.main(common + ["--max-train", "100", "--test-size", "50", "--vocab-size", "500"])
    first = list(runs.saved)
    data = work / "data_spm500_train100_test50"
    assert first == [str(data / "transformer_e1"), str(data / "transformer_local_tied_e1")]
    assert runs.scored == [os.path.join(d, "generate-test.txt") for d in first]
    for settings in (["--max-train", "200"], ["--test-size", "60"], ["--vocab-size", "600"]):
        runs.saved.clear()
        demo.main(common + settings)
        assert not set(runs.saved) & set(first), settings  # no run trained on other data
    assert (work / "results.json").exists()  # the results stay where they were


def test_the_pruning_demo_reuses_the_baseline_of_its_own_data(tmp_path, monkeypatch):
    runs = Recorder(monkeypatch)
    monkeypatch.setattr(prune_demo, "pruned_checkpoint", lambda gated, out: (out, 8))
    work = tmp_path / "demo_runs"
    demo.main(["--work-dir", str(work), "--corpus", "ding-de-en", "--max-train", "100"])
    demo_baseline = runs.saved[0]
    runs.saved.clear()
    argv = ["--work-dir", str(work), "--max-train", "100", "--lambdas", "0.1"]
    prune_demo.main(argv)
    baseline, gated = runs.saved
    assert baseline == demo_baseline == str(work / "data_spm4000_train100" / "transformer_e16")
    assert gated.startswith(baseline + os.sep)  # fine-tunings live under their baseline
    assert os.path.join(baseline, "generate-test.txt") in runs.scored
    runs.saved.clear()
    prune_demo.main(["--work-dir", str(work), "--max-train", "200", "--lambdas", "0.1"])
    assert runs.saved[0] == str(work / "data_spm4000_train200" / "transformer_e16")


@pytest.mark.parametrize(
    "option, value",
    [("--max-train", "0"), ("--epochs", "0"), ("--finetune-epochs", "0"), ("--vocab-size", "0")],
)
def test_the_pruning_demo_refuses_counts_of_nothing(option, value, capsys):
    line = argument_error(prune_demo, [option, value], capsys)
    assert f"argument {option}: must be at least 1, got 0" in line


def test_the_pruning_demo_refuses_demo_epochs_of_nothing(monkeypatch, capsys):
    monkeypatch.setenv("DEMO_EPOCHS", "0")
    assert "argument --epochs: must be at least 1" in argument_error(prune_demo, [], capsys)


@pytest.mark.parametrize(
    "lambdas, problem",
    [
        ("0.1,0.1", "0.1 is given twice"),
        ("0.1,0.10", "0.1 is given twice"),
        ("0.1,-0.2", "must be a positive number"),
        ("0", "must be a positive number"),
        ("nan", "must be a positive number"),
        ("0.1,O.2", "expected comma-separated numbers, got 'O.2'"),
        ("0.1,", "expected comma-separated numbers"),
    ],
)
def test_the_pruning_demo_checks_its_lambdas_before_any_work(tmp_path, lambdas, problem, capsys):
    work = tmp_path / "w"
    with pytest.raises(SystemExit) as exited:
        prune_demo.main(["--work-dir", str(work), f"--lambdas={lambdas}"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --lambdas: " in err and problem in err and "Traceback" not in err
    assert not work.exists()  # nothing prepared, nothing trained


def test_the_pruning_demo_reads_its_lambdas_as_numbers():
    assert prune_demo.parse_args(["--lambdas", "0.05,0.2"]).lambdas == [0.05, 0.2]
    assert prune_demo.parse_args([]).lambdas == [0.02, 0.05, 0.1, 0.2]


def small_corpus(raw, langs=("de", "en"), lines=20):
    os.makedirs(raw, exist_ok=True)
    for split in ("train", "valid", "test"):
        for lang in langs:
            with open(os.path.join(raw, f"{split}.{lang}"), "w") as f:
                f.writelines(f"{lang} sentence number {i} of {split}\n" for i in range(lines))


def test_sentencepiece_says_which_vocabulary_the_data_allows(tmp_path):
    small_corpus(tmp_path)
    with pytest.raises(VocabularyTooLarge) as refused:
        train_sentencepiece([tmp_path / "train.de", tmp_path / "train.en"], tmp_path / "m", 4000)
    assert refused.value.requested == 4000 and 0 < refused.value.largest < 4000


def test_a_killed_sentencepiece_training_leaves_the_previous_model_whole(tmp_path, monkeypatch):
    import sentencepiece

    small_corpus(tmp_path)
    inputs = [tmp_path / "train.de", tmp_path / "train.en"]
    model = train_sentencepiece(inputs, tmp_path / "spm", 29)
    assert model == f"{tmp_path}/spm.model"
    before = {name: (tmp_path / name).read_bytes() for name in ("spm.model", "spm.vocab")}

    with monkeypatch.context() as killed:
        kill_sentencepiece(killed)
        with pytest.raises(KeyboardInterrupt):
            train_sentencepiece(inputs, tmp_path / "spm", 28)
    after = {name: (tmp_path / name).read_bytes() for name in ("spm.model", "spm.vocab")}
    assert after == before and not [n for n in os.listdir(tmp_path) if n.startswith(".")]
    train_sentencepiece(inputs, tmp_path / "spm", 28)  # the next try is whole and replaces it
    assert sentencepiece.SentencePieceProcessor(model_file=model).get_piece_size() == 28


@pytest.mark.parametrize(
    "module, data",
    [(demo, "data_spm4000_train20"), (small_scale_study, "ding-de-en/data_spm4000_train20")],
)
def test_a_vocabulary_larger_than_the_data_is_one_line(tmp_path, module, data):
    work = tmp_path / "w"
    claim_output_dir(str(work), demo.WORK_DIR_OWNER)
    small_corpus(work / data / "raw")  # the extracted slice, as a first run left it
    argv = ["--work-dir", work, "--corpus", "ding-de-en", "--max-train", "20"]
    message = exit_message(module, argv)
    assert message.startswith("error: --vocab-size 4000: the training data allows at most ")
    assert "pass --vocab-size " in message


@pytest.mark.parametrize(
    "seeds, problem",
    [
        ("-1", "must be at least 0, got -1"),
        ("1,-2", "must be at least 0, got -2"),
        ("1,1", "seed 1 is given twice"),
        ("1,x", "expected a whole number, got 'x'"),
    ],
)
def test_the_study_refuses_negative_and_repeated_seeds(seeds, problem, capsys):
    line = argument_error(small_scale_study, [f"--seeds={seeds}"], capsys)
    assert line.endswith(f"argument --seeds: {problem}"), line


def test_the_study_reads_distinct_seeds():
    assert small_scale_study.parse_args(["--seeds", "0,2,5"]).seed_list == [0, 2, 5]
    assert small_scale_study.parse_args([]).seed_list == [1, 2, 3]


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["--section", "to convergence"], "argument --section: 'to convergence': use letters"),
        (["--compare-records", "records"], "--compare-records and --compare-max-update go together"),
        (["--compare-max-update", "8000"], "--compare-records and --compare-max-update go together"),
    ],
)
def test_the_study_refuses_a_bad_section_or_half_a_comparison(argv, problem, capsys):
    assert problem in argument_error(small_scale_study, argv, capsys)


def test_the_speech_study_takes_its_sizes_from_the_profile_and_the_options():
    assert speech_study.parse_args([]).sizes == speech_study.FULL
    args = speech_study.parse_args(["--tiny", "--train-size", "30", "--st-max-update", "9"])
    assert args.sizes.train == 30 and args.sizes.st_max_update == 9
    assert args.sizes.max_words == speech_study.TINY.max_words
    assert speech_study.parse_args(["--seeds", "2,3"]).seed_list == [2, 3]
