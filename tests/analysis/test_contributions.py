"""Contributions (Alastruey et al. 2022, Eqs. 3-6, Algorithm 1) and the contributions CLI."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from fairseq.models.speech_to_text.s2t_transformer import S2TTransformerModel, s2t_transformer_s

from ..speech_data import asr_checkpoint, build_s2t, padded_fbank
from local_attn_fairseq.analysis import cli
from local_attn_fairseq.analysis import contributions as contrib
from local_attn_fairseq.analysis.loading import task_description
from local_attn_fairseq.models.s2t_transformer_local import (
    S2TTransformerLocalModel,
    parse_windows,
    s2t_transformer_local_tiny,
)

SMALL = dict(encoder_embed_dim=32, encoder_ffn_embed_dim=64, conv_channels=32)


def local_model(form):
    torch.manual_seed(0)
    model = build_s2t(
        S2TTransformerLocalModel, s2t_transformer_local_tiny, local_attention_form=form, **SMALL
    )
    return model.eval()


def plain_s2t_model():
    """fairseq's own s2t_transformer (fairseq's MultiheadAttention), small."""
    torch.manual_seed(0)
    options = dict(SMALL, encoder_layers=2, decoder_layers=1)
    return build_s2t(S2TTransformerModel, s2t_transformer_s, **options).eval()


def recorded_layers(model, lengths):
    features, lengths = padded_fbank(lengths)
    layers = contrib.encoder_layers(model)
    with torch.no_grad(), contrib.LayerInputs(layers) as recorder:
        model.encoder(features, lengths)
    return [(layer, *recorder.captured[i]) for i, layer in enumerate(layers)]


# -- the decomposition ------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["banded", "masked", "plain"])
def test_transformed_vectors_rebuild_the_attention_block_output(model):
    """sum_j F_i(x_j) + b_O equals residual + attention(LN(x)) as the model computes it (the
    banded model through its banded operator), for every real frame of a padded batch."""
    model = plain_s2t_model() if model == "plain" else local_model(model)
    for layer, x, padding in recorded_layers(model, [70, 31, 9]):
        with torch.no_grad():
            normed = layer.self_attn_layer_norm(x)
            attn, _ = layer.self_attn(normed, normed, normed, padding, need_weights=False)
            expected = x + attn
            pieces = contrib.layer_pieces(layer, x, padding)
        for b, sentence in enumerate(pieces):
            real = ~padding[b]
            assert sentence.inputs.shape[0] == int(real.sum())
            torch.testing.assert_close(
                contrib.block_output(sentence), expected[real, b], atol=1e-5, rtol=1e-5
            )
            vectors = contrib.transformed_vectors(sentence)
            rebuilt = vectors.sum(dim=1) + sentence.out_bias
            torch.testing.assert_close(rebuilt, expected[real, b], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(
                contrib.contribution_matrix(sentence),
                vectors.double().norm(dim=-1),
                atol=1e-6,
                rtol=1e-6,
            )


def test_local_layers_contribute_nothing_outside_their_window():
    model = local_model("banded")
    for index, (layer, x, padding) in enumerate(recorded_layers(model, [60])):
        window = model.encoder.attention_windows[index]
        matrix = contrib.contribution_matrix(contrib.layer_pieces(layer, x, padding)[0])
        offsets = torch.arange(matrix.shape[0])[None, :] - torch.arange(matrix.shape[0])[:, None]
        outside = matrix[offsets.abs() > (window - 1) // 2] if window else torch.zeros(0)
        assert (outside == 0).all() and (matrix > 0).any()


def test_post_ln_models_are_refused():
    torch.manual_seed(0)
    options = dict(SMALL, encoder_layers=2, decoder_layers=1, encoder_normalize_before=False)
    model = build_s2t(S2TTransformerModel, s2t_transformer_s, **options)
    with pytest.raises(ValueError, match="encoder layer 0 normalises after the residual"):
        contrib.check_decomposable(contrib.encoder_layers(model))


# -- D, CCD, CL on a hand-computed case -------------------------------------------------------
HAND = torch.tensor([[0.5, 0.3, 0.2], [0.25, 0.5, 0.25], [0.1, 0.3, 0.6]], dtype=torch.float64)


def test_diagonality_of_a_hand_computed_matrix():
    # w = 1: the main diagonal; w = 2, 3: one diagonal each side; w >= 4: everything
    expected = [1.6 / 3, 2.7 / 3, 2.7 / 3, 1.0, 1.0, 1.0]
    torch.testing.assert_close(contrib.diagonality(HAND), torch.tensor(expected).double())
    assert contrib.contribution_loss(HAND, 1) == pytest.approx(1 - 1.6 / 3)
    assert contrib.contribution_loss(HAND, 3) == pytest.approx(0.1)
    assert contrib.contribution_loss(HAND, 0) == 0.0  # global attention loses nothing


def test_ccd_is_the_trapezoidal_area_over_the_range_width():
    d = contrib.diagonality(HAND)
    area = (1.6 / 3 + 0.9) / 2 + 0.9 + (0.9 + 1) / 2 + 1 + 1
    assert contrib.cumulative_diagonality(d) == pytest.approx(area / 5)
    assert contrib.cumulative_diagonality(contrib.diagonality(torch.eye(4).double())) == 1.0


def test_rows_are_normalised_to_shares():
    rows = contrib.normalise_rows(torch.tensor([[1.0, 3.0], [0.0, 0.0]]))
    torch.testing.assert_close(rows, torch.tensor([[0.25, 0.75], [0.0, 0.0]]))


# -- Algorithm 1 ------------------------------------------------------------------------------
def banded_matrix(n, half_width, inside=0.05, outside=0.001):
    offsets = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).abs()
    matrix = torch.where(offsets <= half_width, inside, outside).double()
    matrix.fill_diagonal_(0.6)
    return contrib.normalise_rows(matrix)


@pytest.mark.parametrize("half_width", [1, 3, 8])
def test_algorithm_1_finds_a_known_band(half_width):
    matrix = banded_matrix(50, half_width)
    assert contrib.window_size(matrix) == 2 * half_width  # the default convention, 2i
    assert contrib.window_size(matrix, convention="2i") == 2 * half_width
    assert contrib.window_size(matrix, convention="2i+1") == 2 * half_width + 1


def test_algorithm_1_bridges_gaps_shorter_than_a_tenth_of_the_length():
    n = 40  # patience: 4 consecutive diagonals below t
    matrix = banded_matrix(n, 2)
    offsets = torch.arange(n)[None, :] - torch.arange(n)[:, None]
    matrix[offsets == 6] = 0.05  # 3 quiet diagonals (3, 4, 5), then one above t: inside
    matrix[offsets == -15] = 0.05  # after 9 quiet diagonals: outside
    assert contrib.window_size(matrix, convention="2i") == 12
    assert contrib.window_size(matrix, convention="2i+1") == 13


@pytest.mark.parametrize("convention", ["2i", "2i+1"])
def test_algorithm_1_gives_zero_without_an_off_diagonal_above_t(convention):
    assert contrib.window_size(torch.eye(30).double(), convention=convention) == 0
    assert contrib.window_size(torch.ones(1, 1).double(), convention=convention) == 0


def test_unknown_width_convention_is_rejected():
    with pytest.raises(ValueError, match="unknown window width convention '2i-1'"):
        contrib.window_size(torch.eye(3).double(), convention="2i-1")


def table_1_layer_5(convention):
    """200 hand-built sentences: 197 whose contributions pass t up to offset 2, three up to
    offset 3, as in the paper's En-De layer 5 (Table 1: 4.03 +- 0.28, w = 5)."""
    sample = contrib.LayerSample(convention)
    for half_width in [2] * 197 + [3] * 3:
        sample.add(banded_matrix(40, half_width, outside=0.0), contrib.DEFAULT_THRESHOLD)
    return sample.summary(layer=5)


def test_table_1_statistics_under_both_width_conventions():
    even = table_1_layer_5("2i")  # widths 4 (197 sentences) and 6 (3)
    assert even["window_mean"] == pytest.approx(4.03)
    assert even["window_std"] == pytest.approx(math.sqrt(3 * 197) * 2 / 200)  # 0.243
    assert even["window"] == 5  # ceil(4.27) = 5: the paper's window
    odd = table_1_layer_5("2i+1")  # widths 5 and 7: one more each
    assert odd["window_mean"] == pytest.approx(5.03)
    assert odd["window_std"] == pytest.approx(even["window_std"])
    assert odd["window"] == 7  # ceil(5.27) = 6, made odd: two wider than the paper's
    # CL of the paper's window: the offsets-3 sentences lose their outermost diagonals
    assert even["contribution_loss_mean"] > 0 and odd["contribution_loss_mean"] == 0


def test_window_over_a_sample_is_mean_plus_std_made_odd():
    assert contrib.odd_window([3, 5, 7]) == 7  # 5 + 1.63 -> 7
    assert contrib.odd_window([2, 2]) == 3
    assert contrib.odd_window([0, 0, 0]) == 1
    assert contrib.odd_window([0, 0, 0, 1]) == 1  # 0.25 + 0.43 -> 1


def test_windows_chosen_for_the_model():
    summaries = [
        {"window": 17, "contribution_loss_mean": 0.35, "longest": 200},
        {"window": 5, "contribution_loss_mean": 0.23, "longest": 200},
        {"window": 401, "contribution_loss_mean": 0.0, "longest": 200},  # covers every sentence
    ]
    assert contrib.choose_windows(summaries) == [0, 5, 0]
    assert contrib.choose_windows(summaries, max_contribution_loss=0.4) == [17, 5, 0]
    assert contrib.choose_windows(summaries, global_layers=2) == [0, 0, 0]


def test_layer_sample_summary():
    sample = contrib.LayerSample("2i+1")
    for half_width in (1, 2, 3):
        sample.add(banded_matrix(20, half_width, outside=0.0), contrib.DEFAULT_THRESHOLD)
    summary = sample.summary(layer=4)
    assert summary["window_mean"] == 5 and summary["window"] == 7
    assert summary["window_std"] == pytest.approx(math.sqrt(8 / 3))
    assert summary["contribution_loss_mean"] == pytest.approx(0.0)  # 7 covers every band
    assert summary["sentences"] == 3 and summary["longest"] == 20


# -- the CLI ----------------------------------------------------------------------------------
def run_contributions_cli(tmp_path_factory, *extra):
    data, checkpoint = asr_checkpoint(tmp_path_factory)
    out = tmp_path_factory.mktemp("contributions")
    code = cli.main(
        ["contributions", "--path", str(checkpoint), "--data", str(data), "--config-yaml",
         "config_asr.yaml", "--gen-subset", "dev_asr", "--num-sentences", "5",
         "--output-dir", str(out), "--compare-path", str(checkpoint),
         "--compare-config-yaml", "config_asr.yaml", "--compare-gen-subset", "dev_asr",
         "--batch-size", "2", *extra],
    )  # fmt: skip
    assert code == 0
    return out, json.loads((out / "contributions.json").read_text())


def table_1_rows(printed):
    """[(label, [(layer, star, mu, sigma, w, CL mean, CL std, used)])] of the printed blocks, in
    order."""
    blocks = []
    for line in printed.splitlines():
        if ": " in line and " sentences, t = " in line:
            blocks.append((line.split(": ")[0], []))
        parts = line.replace("+-", " ").split()
        if blocks and parts and parts[0].isdigit():
            star = parts[1] == "*"
            parts = [parts[0]] + parts[1 + star :]
            used = parts[8] if len(parts) > 8 else None
            blocks[-1][1].append(
                (int(parts[0]), star, float(parts[1]), float(parts[2]), int(parts[3]),
                 float(parts[4]), float(parts[5]), used)
            )  # fmt: skip
    return blocks


def test_contributions_cli_end_to_end(tmp_path_factory, capsys):
    out, results = run_contributions_cli(tmp_path_factory)
    printed = capsys.readouterr().out
    assert "--encoder-attention-windows" in printed
    assert "Algorithm 1 per-sentence width 2i; w = ceil(mu + sigma), made odd" in printed
    assert "(*) standard self-attention in windows.txt: CL >= 0.25" in printed
    # one Table-1 block per model, titled with its task (the ASR checkpoint twice), line by line
    # the numbers of contributions.json
    blocks = table_1_rows(printed)
    assert [label for label, _ in blocks] == ["speech recognition"] * 2
    assert results["label"] == results["compare"]["label"] == "speech recognition"
    for (_, rows), layers in zip(blocks, (results["layers"], results["compare"]["layers"])):
        assert [r[0] for r in rows] == [1, 2, 3, 4, 5, 6]
        for row, s in zip(rows, layers):
            assert row[2:7] == (
                round(s["window_mean"], 2), round(s["window_std"], 2), s["window"],
                round(s["contribution_loss_mean"], 2), round(s["contribution_loss_std"], 2),
            )  # fmt: skip
    for row, s in zip(blocks[0][1], results["layers"]):
        assert row[1] == (s["chosen_window"] == 0)
        assert row[7] == ("global" if s["chosen_window"] == 0 else str(s["chosen_window"]))
    assert results["num_sentences"] == 5 and len(results["layers"]) == 6
    assert results["width_convention"] == "2i"
    compared = [{k: v for k, v in s.items() if k != "chosen_window"} for s in results["layers"]]
    assert results["compare"]["task"] == results["task"] == "speech recognition"
    assert results["compare"]["layers"] == compared  # the same checkpoint twice
    windows = (out / "windows.txt").read_text().strip()
    assert windows == results["encoder_attention_windows"]
    assert parse_windows(windows, 6) == [s["chosen_window"] for s in results["layers"]]
    # the trained model's windowed layers cannot reach beyond their windows
    assert [s["window"] for s in results["layers"]][2:] == [3, 5, 5, 7]
    for figure in ("contribution_matrices.png", "ccd.png"):
        assert (out / figure).stat().st_size > 1000


def test_contributions_cli_width_conventions(tmp_path_factory, capsys):
    """The same sentences under 2i+1: every non-zero width one larger."""
    _, even = run_contributions_cli(tmp_path_factory)
    _, odd = run_contributions_cli(tmp_path_factory, "--window-width-convention", "2i+1")
    assert "Algorithm 1 per-sentence width 2i+1;" in capsys.readouterr().out
    assert odd["width_convention"] == "2i+1"
    # the banded layers (windows 3, 5, 5, 7) use their whole band in every sentence: 2i + 1
    # widths are the band, 2i widths one less, and both choose the band as w
    assert [s["window_mean"] for s in odd["layers"]][2:] == [3, 5, 5, 7]
    assert [s["window_mean"] for s in even["layers"]][2:] == [2, 4, 4, 6]
    assert [s["window_std"] for s in odd["layers"] + even["layers"]][2:6] == [0] * 4
    for a, b in zip(even["layers"], odd["layers"]):
        assert b["window"] in (a["window"], a["window"] + 2)
    assert [s["window"] for s in even["layers"]][2:] == [3, 5, 5, 7]
    assert [s["window"] for s in odd["layers"]][2:] == [3, 5, 5, 7]


def test_contributions_cli_names_a_missing_subset(tmp_path_factory, capsys):
    data, checkpoint = asr_checkpoint(tmp_path_factory)
    code = cli.main(
        ["contributions", "--path", str(checkpoint), "--data", str(data), "--config-yaml",
         "config_asr.yaml", "--gen-subset", "test_asr", "--output-dir",
         str(tmp_path_factory.mktemp("none"))],
    )  # fmt: skip
    assert code == 2
    assert "cannot load subset 'test_asr'" in capsys.readouterr().err


def test_the_report_of_a_translation_checkpoint_names_translation(
    translation_checkpoint, tiny_data, tmp_path, capsys
):
    # the title names what the model was trained for, never a fixed "ASR"
    out = tmp_path / "out"
    code = cli.main(
        ["contributions", "--path", str(translation_checkpoint), "--data", str(tiny_data / "bin"),
         "--gen-subset", "valid", "--num-sentences", "3", "--output-dir", str(out), "--cpu"]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert [label for label, _ in table_1_rows(printed)] == ["translation (de-en)"]
    assert "ASR" not in printed
    results = json.loads((out / "contributions.json").read_text())
    assert results["label"] == results["task"] == "translation (de-en)"


def test_a_label_given_replaces_the_task_in_the_title(tmp_path_factory, capsys):
    _, results = run_contributions_cli(tmp_path_factory, "--label", "mine", "--compare-label", "b")
    assert [label for label, _ in table_1_rows(capsys.readouterr().out)] == ["mine", "b"]
    assert results["task"] == "speech recognition" and results["compare"]["label"] == "b"


def loaded_model(task, train_subset="train", config_yaml=None, langs=(None, None)):
    """What task_description reads of a loaded checkpoint: its task and training data."""
    task_cfg = SimpleNamespace(_name=task, config_yaml=config_yaml)
    cfg = SimpleNamespace(task=task_cfg, dataset=SimpleNamespace(train_subset=train_subset))
    task_object = SimpleNamespace(cfg=SimpleNamespace(source_lang=langs[0], target_lang=langs[1]))
    return SimpleNamespace(cfg=cfg, task=task_object)


@pytest.mark.parametrize(
    "loaded, description",
    [
        (loaded_model("translation", langs=("de", "en")), "translation (de-en)"),
        (loaded_model("translation_multi_simple_epoch"), "translation"),
        (loaded_model("speech_to_text", "train_asr", "config_asr.yaml"), "speech recognition"),
        (loaded_model("speech_to_text", "train_st"), "speech translation"),
        (loaded_model("speech_to_text", "train", "config_st.yaml"), "speech translation"),
        (loaded_model("speech_to_text", "train_asr,train_st"), "speech to text"),
        (loaded_model("speech_to_text", "train", "config.yaml"), "speech to text"),
        (loaded_model("language_modeling"), "language model"),
        (loaded_model("sentence_prediction"), "sentence classification"),
        (loaded_model("audio_pretraining"), "audio_pretraining"),
    ],
)  # fmt: skip
def test_the_task_of_a_checkpoint_in_words(loaded, description):
    assert task_description(loaded) == description
