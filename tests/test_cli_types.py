"""Counts on the command line: refused by argparse with the option's name, before any work."""

import argparse
import os

import pytest

from local_attn_fairseq.cli_types import int_at_least, non_negative_int, positive_int

from .conftest import run_script


def test_int_at_least_accepts_the_minimum_and_refuses_below_it_or_non_numbers():
    assert positive_int("1") == 1 and non_negative_int("0") == 0 and int_at_least(-2)("-2") == -2
    with pytest.raises(argparse.ArgumentTypeError, match="must be at least 1, got 0"):
        positive_int("0")
    with pytest.raises(argparse.ArgumentTypeError, match="must be at least 0, got -1"):
        non_negative_int("-1")
    with pytest.raises(argparse.ArgumentTypeError, match="expected a whole number, got '2.5'"):
        positive_int("2.5")


@pytest.mark.parametrize(
    "script, argv, env, message",
    [
        ("demo.py", ["--epochs", "0"], {}, "argument --epochs: must be at least 1, got 0"),
        ("demo.py", [], {"DEMO_EPOCHS": "0"}, "argument --epochs: must be at least 1, got 0"),
        ("demo_speech.py", ["--train-size", "0"], {}, "argument --train-size: must be at least 1"),
        ("small_scale_study.py", ["--jobs", "0"], {}, "argument --jobs: must be at least 1"),
        ("small_scale_study.py", ["--patience", "-1"], {}, "--patience: must be at least 0"),
        ("prepare_bible.py", ["--out-dir", "x", "--max-train", "0"], {}, "--max-train: must be"),
        ("prepare_ding.py", ["--out-dir", "x", "--test-size", "-5"], {}, "--test-size: must be"),
        (
            "prepare_classification.py",
            ["--ding-dir", "d", "--out-dir", "x", "--workers", "0"],
            {},
            "argument --workers: must be at least 1, got 0",
        ),
        (
            "data/prepare_mustc.py",
            ["--mustc-root", "r", "--max-frames", "-1"],
            {},
            "argument --max-frames: must be at least 0, got -1",
        ),
        (
            "data/synthesize_speech_corpus.py",
            ["--out-dir", "x", "--workers", "0"],
            {},
            "argument --workers: must be at least 1, got 0",
        ),
    ],
)
def test_the_tools_refuse_counts_below_their_minimum_before_any_work(
    tmp_path, script, argv, env, message
):
    # the script in this process: an argparse error needs no Python start and fairseq import
    proc = run_script(os.path.join("scripts", script), *argv, cwd=tmp_path, env=env)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and os.listdir(tmp_path) == []
