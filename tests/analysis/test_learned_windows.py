"""Learned windows (Yang et al. Figs. 2-3, Nguyen et al.): the maths and the subcommand."""

import pytest
import torch

from local_attn_fairseq.analysis.cli import main
from local_attn_fairseq.analysis.learned_windows import expected_window

from ..conftest import USER_DIR, fairseq_cli
from ..models.test_language_model import LM_TINY, LM_TRAIN
from .conftest import analyze, read_json


def test_expected_window_of_sure_pointers_is_the_span():
    phi_l = torch.zeros(2, 6)
    phi_r = torch.zeros(2, 6)
    phi_l[0, 1] = phi_r[0, 4] = 1.0  # window 1..4
    phi_l[1, 5] = phi_r[1, 2] = 1.0  # crossed pointers span 2..5
    read = expected_window(phi_l, phi_r)
    assert read["size"].tolist() == [4.0, 4.0]
    assert read["left"].tolist() == [1.0, 5.0] and read["right"].tolist() == [4.0, 2.0]


def test_expected_window_of_uncertain_pointers():
    phi_l = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    phi_r = torch.tensor([[0.0, 0.0, 0.5, 0.5], [0.0, 0.0, 0.0, 0.0]])
    read = expected_window(phi_l, phi_r)
    # |r - l| is 2, 3, 1, 2 with probability 1/4 each
    assert read["size"][0].item() == 3.0 and read["left"][0].item() == 0.5
    assert read["defined"].tolist() == [True, False]  # a query without keys has no window


def test_subcommand_reads_gaussian_and_dynamic_windows(window_checkpoint, tiny_data, tmp_path):
    out = tmp_path / "out"
    proc = analyze(
        "windows", "--path", window_checkpoint, "--data", tiny_data / "bin",
        "--gen-subset", "valid", "--max-sentences", 3, "--output-dir", out, "--cpu",
    )  # fmt: skip
    result = read_json(out / "windows.json")
    gaussian, dynamic = result["mechanisms"]["gaussian"], result["mechanisms"]["dynamic"]
    assert [(e["attention"], e["layer"]) for e in gaussian] == [("encoder_self", 0)]
    assert [(e["attention"], e["layer"]) for e in dynamic] == [
        ("encoder_self", 1),
        ("decoder_self", 0),
        ("decoder_cross", 0),
    ]
    assert gaussian[0]["window"]["mean"] > 0 and len(gaussian[0]["window"]["per_head_mean"]) == 8
    offset, distance = gaussian[0]["offset"], gaussian[0]["distance"]
    assert distance["mean"] >= abs(offset["mean"]) and distance["q1"] >= 0
    assert len(distance["per_head_mean"]) == 8
    for entry in dynamic:
        assert entry["size"]["q1"] >= 1
    assert "right_offset" in dynamic[1] and "right_offset" not in dynamic[2]
    assert dynamic[1]["right_offset"]["q3"] <= 0  # a causal decoder cannot point ahead
    for name in ("windows_gaussian.png", "windows_dynamic.png"):
        assert (out / name).stat().st_size > 1000
    assert "mean size" in proc.stdout and "|centre-i|" in proc.stdout


def test_model_without_learned_windows_gets_a_clear_message(trained_checkpoint, tiny_data, capsys):
    status = main(
        ["windows", "--path", str(trained_checkpoint), "--data", str(tiny_data / "bin"), "--cpu"]
    )
    assert status == 2
    assert "neither Gaussian localness heads" in capsys.readouterr().err


@pytest.fixture(scope="module")
def language_model(tiny_data, tmp_path_factory):
    """fairseq-train of a tiny transformer_lm_dynwin (Dec(AW) in every layer) for two updates,
    on the English side of the tiny corpus; returns (checkpoint, data)."""
    small, data = tiny_data / "small", tmp_path_factory.mktemp("lm_bin")
    fairseq_cli(
        "fairseq-preprocess", "--only-source", "--trainpref", small / "train.en",
        "--validpref", small / "valid.en", "--testpref", small / "test.en",
        "--destdir", data, "--workers", 1,
    )  # fmt: skip
    save_dir = tmp_path_factory.mktemp("lm_windows")
    fairseq_cli(
        "fairseq-train", data, "--user-dir", USER_DIR, "--arch", "transformer_lm_dynwin_tiny",
        *LM_TINY, *LM_TRAIN, "--dynamic-window", "decoder_self:aw:0-2", "--save-dir", save_dir,
    )  # fmt: skip
    return save_dir / "checkpoint_last.pt", data


def test_windows_of_a_language_model_are_its_decoder_self_attention(language_model, tmp_path):
    checkpoint, data = language_model
    out = tmp_path / "out"
    analyze("windows", "--path", checkpoint, "--data", data, "--gen-subset", "valid",
            "--max-sentences", 2, "--output-dir", out, "--cpu")  # fmt: skip
    dynamic = read_json(out / "windows.json")["mechanisms"]["dynamic"]
    assert [(e["attention"], e["layer"]) for e in dynamic] == [
        ("decoder_self", 0), ("decoder_self", 1), ("decoder_self", 2),
    ]  # fmt: skip
    for entry in dynamic:
        assert entry["size"]["q1"] >= 1 and entry["right_offset"]["q3"] <= 0  # causal
    assert (out / "windows_dynamic.png").stat().st_size > 1000


@pytest.mark.parametrize("subcommand", ["bias", "contributions"])
def test_encoder_analyses_of_a_language_model_say_it_has_no_encoder(
    language_model, tmp_path, subcommand
):
    checkpoint, data = language_model
    proc = analyze(subcommand, "--path", checkpoint, "--data", data, "--gen-subset", "valid",
                   "--output-dir", tmp_path / "out", "--cpu", check=False)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "has no encoder self-attention" in proc.stderr.strip().splitlines()[-1]
