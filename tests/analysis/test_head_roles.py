"""Confidence and roles of heads (Voita et al. 2019): known answers and the ``heads``
subcommand."""

import os

import pytest
import torch

from local_attn_fairseq.analysis.dependencies import align_pieces, read_conllu, relation_pairs
from local_attn_fairseq.analysis.head_roles import (
    HeadStatistics,
    Thresholds,
    head_choices,
    relation_name,
    role_label,
)
from local_attn_fairseq.analysis.lrp import attention_weights, record_forward

from .conftest import CONLLU, DATA, SOURCE_LINES, one_layer_model, read_json

EOS, PAD = 2, 1
SUBJECTS = DATA / "heads_subjects.en.conllu"


def test_choices_skip_eos_and_empty_rows_and_normalise_rows():
    weights = torch.tensor(
        [
            [[0.0, 0.0, 0.0], [0.2, 0.0, 0.0], [0.1, 0.1, 0.8]],  # a masked head (rows < 1)
            [[0.1, 0.2, 0.7], [0.6, 0.3, 0.1], [0.3, 0.3, 0.4]],  # softmax rows
        ]
    )
    tokens = torch.tensor([10, 11, EOS])
    choices = head_choices(weights, tokens, tokens, excluded=[EOS, PAD])
    # row 0 of head 0 is empty, every row of the EOS query is left out
    assert choices.counted.tolist() == [[False, True, False], [True, True, False]]
    assert choices.choice[:, :2].tolist() == [[0, 0], [1, 0]]  # EOS is never chosen
    torch.testing.assert_close(choices.confidence[:, :2], torch.tensor([[0.0, 1.0], [0.2, 0.6]]))


def statistics(num_heads, counts=None, **thresholds):
    # as in a fairseq dictionary: <s>, <pad>, </s>, <unk> count 1, then decreasing counts
    counts = counts if counts is not None else [1] * 4 + [100 - i for i in range(39)]
    return HeadStatistics(num_heads, counts, excluded=[0, PAD, EOS], unknown=3, **thresholds)


def test_prev_one_head_is_positional_with_confidence_one(tiny_data):
    """Pande's prev-1 mask keeps the softmax weight of i-1 only: after dividing the row by its
    sum the head is sure, and always one step back."""
    model, task = one_layer_model(tiny_data, "prev-1")
    line = "Der Hund schläft im Garten hinter dem großen Haus ."
    tokens = task.source_dictionary.encode_line(line, add_if_not_exist=False).long()
    sample = {"net_input": {"src_tokens": tokens[None], "src_lengths": torch.tensor([len(tokens)])}}
    record, logits = record_forward(model, sample)
    assert logits is None  # no target: the encoder alone ran
    weights = attention_weights(record)[("encoder_self", 0)][0]
    stats = HeadStatistics(8, task.source_dictionary.count, excluded=[EOS, PAD, 0], unknown=3)
    stats.add(weights, tokens, tokens)
    for head in stats.summary(Thresholds()):
        assert head["positional"] == {"offset": -1, "fraction": 1.0}
        assert head["confidence"] == pytest.approx(1.0)
        assert head["queries"] == len(tokens) - 2  # no EOS query, no key before the first token
        assert head["roles"] == ["positional"] and role_label(head) == "-1"


def sentence_pieces(tree):
    return [word.form for word in tree.words] + ["</s>"]


def test_head_following_subject_arcs_is_syntactic_and_beats_the_baseline():
    """Head 0 points every word at its syntactic head, head 1 at the previous token. Subjects
    sit 1 or 2 words before their verbs, so the positional baseline is right half the time."""
    stats = statistics(2)
    for tree in read_conllu(SUBJECTS):
        pieces = sentence_pieces(tree)
        pairs = relation_pairs(tree, align_pieces(pieces, tree))
        length = len(pieces)
        weights = torch.zeros(2, length, length)
        for word in tree.words:
            position = word.id - 1
            weights[0, position, (word.head or word.id) - 1] = 1.0  # the root: itself
            weights[1, position, max(position - 1, 0)] = 1.0
        weights[:, -1, -1] = 1.0
        tokens = torch.tensor([10 + i for i in range(length - 1)] + [EOS])
        stats.add(weights, tokens, tokens, pairs)
    baselines = stats.baselines()
    assert baselines[("nsubj", "dependent->head")] == {"offset": 1, "accuracy": 0.5, "queries": 4}
    following, previous = stats.summary(Thresholds(min_relation_queries=3))
    subject = following["syntactic"]["nsubj dependent->head"]
    assert (subject["accuracy"], subject["queries"], subject["syntactic"]) == (1.0, 4, True)
    assert "dobj dependent->head" in following["syntactic"]  # UD's obj counts as dobj
    assert following["roles"] == ["syntactic"]
    assert previous["syntactic"]["nsubj dependent->head"]["accuracy"] == 0.0
    assert "syntactic" not in previous["roles"]
    # too few queries: the accuracy is reported but gives no role
    following, _ = stats.summary(Thresholds(min_relation_queries=5))
    assert following["roles"] == []


def test_relation_names_follow_voita():
    assert [relation_name(r) for r in ("nsubj:pass", "obj", "dobj", "amod", "det")] == [
        "nsubj", "dobj", "dobj", "amod", None,
    ]  # fmt: skip


def test_rare_words_head_points_at_the_rarest_token():
    # ids 4.. have decreasing counts: 42 is the rarest token of the vocabulary
    stats = statistics(2, rare_top_n=10)
    rare_sentence = torch.tensor([4, 42, 5, 6, EOS])  # rarest: position 1, not in the top 10
    frequent_sentence = torch.tensor([4, 5, 6, EOS])  # rarest (6) is in the top 10: skipped
    for tokens in (rare_sentence, frequent_sentence):
        length = len(tokens)
        weights = torch.zeros(2, length, length)
        rarest = 1 if length == 5 else 2
        weights[0, :, rarest] = 1.0
        weights[1] = torch.eye(length)
        stats.add(weights, tokens, tokens)
    rare, identity = stats.summary(Thresholds(rare_top_n=10))
    assert rare["rare_words"] == {"fraction": 1.0, "queries": 4, "sentences": 1}
    assert rare["roles"] == ["rare words"] and role_label(rare) == "rare"
    assert identity["rare_words"]["fraction"] == 0.25
    assert identity["roles"] == ["positional"]


def test_unknown_tokens_are_never_the_rarest():
    stats = statistics(1, rare_top_n=0)
    tokens = torch.tensor([3, 40, EOS])  # 3 is <unk>: count 1, yet not a rare word
    weights = torch.zeros(1, 3, 3)
    weights[0, :, 1] = 1.0
    stats.add(weights, tokens, tokens)
    assert stats.summary(Thresholds(rare_top_n=0))[0]["rare_words"]["fraction"] == 1.0


def test_thresholds_are_checked():
    with pytest.raises(ValueError, match=r"positional must lie in \[0, 1\]"):
        Thresholds(positional=90)
    with pytest.raises(ValueError, match="min_relation_queries"):
        Thresholds(min_relation_queries=0)


def test_subcommand_on_a_trained_checkpoint(trained_checkpoint, tiny_data, tmp_path, capsys):
    """transformer_local_tied: heads 0-1 identity, 2 prev-1, 3 prev-2, 4 next-1, 5 next-2 in
    every encoder layer (heads 6-7 are bands). Run through the console script's entry point
    in this process (a new process costs seconds of imports)."""
    from local_attn_fairseq.analysis.cli import main

    out = tmp_path / "out"
    code = main(
        ["heads", "--path", str(trained_checkpoint), "--data", str(tiny_data / "bin"),
         "--gen-subset", "valid", "--max-sentences", "3", "--output-dir", str(out), "--cpu"]
    )  # fmt: skip
    assert code == 0
    result = read_json(out / "heads.json")
    assert (out / "heads.png").stat().st_size > 10000
    layers = result["attention"]["encoder_self"]
    assert [layer["layer"] for layer in layers] == list(range(6))
    for layer in layers:
        heads = layer["heads"]
        assert [h["head"] for h in heads] == list(range(8))
        assert sum(h["relevance"] for h in heads) == pytest.approx(1.0)
        offsets = [h["positional"]["offset"] for h in heads[:6]]
        assert offsets == [0, 0, -1, -2, 1, 2]
        assert all(h["confidence"] == pytest.approx(1.0) for h in heads[:6])
        assert all("positional" in h["roles"] for h in heads[:6])
    assert result["relevance"]["rule"] == "alpha-beta" and result["relevance"]["target_steps"] > 0
    printed = capsys.readouterr().out
    assert "encoder_self" in printed and "wrote heads.json" in printed


def test_subcommand_with_parses_and_cross_attention(
    trained_checkpoint, tiny_data, source_text, tmp_path, capsys
):
    from local_attn_fairseq.analysis.cli import main

    out = tmp_path / "out"
    common = ["heads", "--path", str(trained_checkpoint), "--data", str(tiny_data / "bin"),
              "--source-text", str(source_text), "--conllu", str(CONLLU), "--cpu",
              "--output-dir", str(out), "--attention-type", "encoder_self",
              "decoder_cross"]  # fmt: skip
    # decoder attention needs targets
    assert main(common) == 2
    assert "decoder_cross needs target sentences" in capsys.readouterr().err
    target_text = tmp_path / "target.txt"
    target_text.write_text("\n".join(SOURCE_LINES) + "\n", encoding="utf-8")
    assert main(common + ["--target-text", str(target_text)]) == 0
    result = read_json(out / "heads.json")
    assert result["syntax"]["aligned_sentences"] == 2
    assert ("nsubj dependent->head") in result["syntax"]["baselines"]
    assert set(result["attention"]) == {"encoder_self", "decoder_cross"}
    cross = result["attention"]["decoder_cross"]
    assert len(cross) == 2 and all(h["relevance"] is not None for h in cross[0]["heads"])
    assert "nsubj" in str(result["attention"]["encoder_self"][0]["heads"][0]["syntactic"])


def test_subcommand_refuses_bad_thresholds(trained_checkpoint, tmp_path, capsys):
    from local_attn_fairseq.analysis.cli import main

    with pytest.raises(SystemExit) as refused:
        main(["heads", "--path", str(trained_checkpoint), "--positional-threshold", "2",
              "--output-dir", str(tmp_path)])  # fmt: skip
    assert refused.value.code == 2
    assert "argument --positional-threshold: must lie in [0, 1], got 2" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []  # refused before the checkpoint is read
