"""Counts and selectors on the command line: a count below its minimum or a selector that
selects nothing is refused with the option's name, before any work."""

import argparse
import os

import pytest

from local_attn_fairseq.cli_types import (
    dynamic_windows,
    int_at_least,
    layer_selection,
    localness_layers,
    non_negative_int,
    positive_int,
)

from .conftest import TINY_MODEL, TRAIN, USER_DIR, fairseq_cli, run_script
from .models.helpers import build_model


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


# -- layer selectors ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "selector, layers",
    [("all", [0, 1, 2, 3]), ("2", [2]), ("1-3", [1, 2, 3]), ("0 - 1, 3", [0, 1, 3]),
     (2, [2]), ("3,0", [3, 0])],
)  # fmt: skip
def test_a_layer_selector_selects_the_layers_it_names(selector, layers):
    assert layer_selection(selector, 4) == layers


@pytest.mark.parametrize(
    "selector, message",
    [
        ("2-0", "layer selector '2-0' runs backwards and selects no layer; write '0-2'"),
        ("1,3-2", "layer selector '1,3-2': the range '3-2' runs backwards"),
        ("", "layer selector '' selects no layer"),
        (" ", "layer selector ' ' selects no layer"),
        (None, "layer selector None selects no layer"),
        ("0,,1", "layer selector '0,,1' is not N, 'A-B' (A <= B), 'A,B,...' or 'all'"),
        ("-1", "layer selector '-1' is not N"),
        ("first", "layer selector 'first' is not N"),
        ("4", "layer 4 does not exist; the model has 4 layers (numbered 0-3)"),
    ],
)
def test_a_layer_selector_that_selects_nothing_or_no_layer_of_the_model_is_refused(
    selector, message
):
    with pytest.raises(ValueError) as error:
        layer_selection(selector, 4)
    assert str(error.value).startswith(message)


def test_without_the_models_depth_a_selector_is_read_but_not_bounded():
    assert layer_selection("all") is None and layer_selection("7-9") == [7, 8, 9]
    with pytest.raises(ValueError, match="runs backwards"):
        layer_selection("9-7")


@pytest.mark.parametrize(
    "read, value, message",
    [
        (localness_layers, "encoder_self:0 decoder_self:2-1",
         "--localness-layers entry decoder_self:2-1: layer selector '2-1' runs backwards"),
        (localness_layers, "", "--localness-layers '' selects nothing"),
        (localness_layers, "encoder_self:", "--localness-layers entry encoder_self:: layer "
         "selector '' selects no layer"),
        (dynamic_windows, "encoder_self:aw:3-0", "--dynamic-window entry encoder_self:aw:3-0: "
         "layer selector '3-0' runs backwards"),
        (dynamic_windows, "  ", "--dynamic-window '  ' selects nothing"),
        (dynamic_windows, "encoder_self:aw", "--dynamic-window entry encoder_self:aw is not "
         "TYPE:METHOD:LAYERS"),
    ],
)  # fmt: skip
def test_the_layer_options_name_themselves_and_the_entry_that_selects_nothing(
    read, value, message
):
    with pytest.raises(ValueError) as error:
        read(value)
    assert str(error.value).startswith(message)


def test_the_layer_options_keep_every_entry():
    assert localness_layers("encoder_self:0-2 decoder_cross:all") == {
        "encoder_self": "0-2", "decoder_cross": "all"
    }  # fmt: skip
    assert dynamic_windows("encoder_self:aw-seg:1,3 decoder_self:none") == {
        "encoder_self": "aw-seg:1,3", "decoder_self": "none"
    }  # fmt: skip


# Through fairseq's own option parsing and the plugin's model registration, as fairseq-train
# builds the model before training. Each value selects nothing: taken as given, the layers would
# stay global, or an arch's default layers or attention types would take its place.
@pytest.mark.parametrize(
    "arch, options, message",
    [
        ("transformer_local", ["--localness-layers", "encoder_self:2-0"],
         "--localness-layers entry encoder_self:2-0: layer selector '2-0' runs backwards"),
        ("transformer_localness", ["--localness-layers", ""],
         "--localness-layers '' selects nothing"),
        ("transformer_local", ["--dynamic-window", "decoder_self:mw:1-0"],
         "--dynamic-window entry decoder_self:mw:1-0: layer selector '1-0' runs backwards"),
        ("transformer_dynwin", ["--dynamic-window", ""], "--dynamic-window '' selects nothing"),
        ("transformer_local", ["--locality-config", "{encoder_self: {3-1: [band-1, band-1, "
         "band-1, band-1, band-1, band-1, band-1, band-1]}}"],
         "encoder_self layer 3-1: layer selector '3-1' runs backwards"),
        ("transformer_local", ["--head-gates", ","], "--head-gates ',' names no attention type"),
        ("transformer_local", ["--head-gates", ""], "--head-gates '' names no attention type"),
        ("transformer_local", ["--relative-positions", "4", "--relative-positions-attention", ""],
         "--relative-positions-attention '' names no attention type"),
    ],
)  # fmt: skip
def test_fairseq_refuses_a_model_option_that_selects_nothing_before_training(
    tiny_data, arch, options, message
):
    with pytest.raises(ValueError) as error:
        build_model(tiny_data / "bin", arch, *TINY_MODEL, *options)
    assert message in str(error.value)


def test_fairseq_train_stops_before_training_at_a_reversed_range(tiny_data, tmp_path):
    proc = fairseq_cli(
        "fairseq-train", tiny_data / "bin", "--user-dir", USER_DIR, "--arch", "transformer_local",
        *TINY_MODEL, *TRAIN, "--max-update", 1, "--save-dir", tmp_path, "--dynamic-window",
        "encoder_self:aw:2-0", check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "--dynamic-window entry encoder_self:aw:2-0: layer selector '2-0' runs backwards" in (
        proc.stderr
    )
    assert "begin training" not in proc.stdout + proc.stderr
    assert not (tmp_path / "checkpoint_last.pt").exists()
