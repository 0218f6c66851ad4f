"""The demo's command line: the corpus ``make demo`` trains on, and where each corpus's runs go."""

import os

import pytest

from local_attn_fairseq.experiments import demo


@pytest.fixture(autouse=True)
def no_demo_epochs(monkeypatch):
    monkeypatch.delenv("DEMO_EPOCHS", raising=False)


def test_make_demo_trains_on_the_bible_by_default():
    args = demo.parse_args([])
    assert (args.corpus, args.epochs) == ("bible-en-es", 2)


def test_ding_is_one_option_away_with_its_own_epochs():
    args = demo.parse_args(["--corpus", "ding-de-en"])
    assert (args.corpus, args.epochs) == ("ding-de-en", 16)
    assert demo.parse_args(["--corpus", "ding-de-en", "--epochs", "4"]).epochs == 4


def test_demo_epochs_from_the_environment_apply_to_either_corpus(monkeypatch):
    monkeypatch.setenv("DEMO_EPOCHS", "5")
    assert demo.parse_args([]).epochs == 5
    assert demo.parse_args(["--corpus", "ding-de-en"]).epochs == 5


def test_an_unknown_corpus_is_refused(capsys):
    with pytest.raises(SystemExit):
        demo.parse_args(["--corpus", "wmt14-en-de"])
    assert "invalid choice: 'wmt14-en-de'" in capsys.readouterr().err


def test_ding_runs_stay_at_the_top_of_the_work_folder_where_the_pruning_demo_reads_them():
    work = "demo_runs"
    assert demo.corpus_work_dir(work, "ding-de-en") == work
    assert demo.corpus_work_dir(work, "bible-en-es") == os.path.join(work, "bible-en-es")
