"""CoNLL-U reading, piece-to-word alignment and relation pairs."""

import argparse
import importlib.util

import pytest
import torch

from local_attn_fairseq.analysis.dependencies import (
    DependencyTree,
    SourceSyntax,
    Word,
    align_pieces,
    parse_with_spacy,
    piece_words,
    read_conllu,
    related_matrix,
    relation_pairs,
    sentence_positions,
    token_sets,
    trees_from_spacy,
)

from local_attn_fairseq.analysis.loading import LoadedModel, read_sentences

from .conftest import CONLLU, SOURCE_LINES

GOOD_LINE = "1\tHund\tHund\tNOUN\tNN\t_\t0\troot\t_\t_"


def test_reads_multiword_tokens_and_skips_empty_nodes():
    first, second = read_conllu(CONLLU)
    assert first.text == "Max wartet auf Annas Anruf."
    assert [w.form for w in first.words] == ["Max", "wartet", "auf", "Annas", "Anruf", "."]
    assert first.arcs()[0] == (1, 2, "nsubj")
    assert len(second.words) == 11  # the empty node 6.1 is not a word
    assert ("im", (4, 5)) in second.tokens and ("in", (4,)) not in second.tokens
    assert second.origin.endswith("line 10")


@pytest.mark.parametrize(
    "lines, line_number, message",
    [
        ([GOOD_LINE, "2\tbellt\tbellen\tVERB"], 2, "10 tab-separated fields"),
        ([GOOD_LINE, "3\tbellt\t_\t_\t_\t_\t1\tdep\t_\t_"], 2, "out of order"),
        ([GOOD_LINE, "2\tbellt\t_\t_\t_\t_\tx\tdep\t_\t_"], 2, "bad HEAD"),
        ([GOOD_LINE, "2\tbellt\t_\t_\t_\t_\t9\tdep\t_\t_"], 2, "not a word of this sentence"),
        ([GOOD_LINE, "2\tbellt\t_\t_\t_\t_\t2\tdep\t_\t_"], 2, "its own head"),
        ([GOOD_LINE, "2\tbellt\t_\t_\t_\t_\t1\t_\t_\t_"], 2, "missing DEPREL"),
        ([GOOD_LINE, "3-4\tzum\t_\t_\t_\t_\t_\t_\t_\t_"], 2, "does not cover the next words"),
        ([GOOD_LINE, "2-3\tzum\t_\t_\t_\t_\t_\t_\t_\t_"], 2, "missing"),
        (["# only a comment"], 0, "without word lines"),
        (["x\tHund\t_\t_\t_\t_\t0\troot\t_\t_"], 1, "bad ID"),
    ],
)
def test_malformed_conllu_names_file_and_line(tmp_path, lines, line_number, message):
    path = tmp_path / "bad.conllu"
    path.write_text("# sent_id = 1\n" + "\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=f"bad.conllu, line {line_number + 1}: .*{message}"):
        read_conllu(path)


def test_second_sentence_errors_count_lines_across_sentences(tmp_path):
    path = tmp_path / "two.conllu"
    path.write_text(f"{GOOD_LINE}\n\n{GOOD_LINE}\n2\tx\n", encoding="utf-8")
    with pytest.raises(ValueError, match="two.conllu, line 4:"):
        read_conllu(path)


def test_sentencepiece_pieces_align_by_characters():
    tree = read_conllu(CONLLU)[1]
    pieces = "▁Der ▁Hund ▁schl äft ▁im ▁Gar ten ▁hinter ▁dem ▁großen ▁Haus . </s>".split()
    alignment = align_pieces(pieces, tree)
    words = [sorted(w) for w in alignment.words_of_piece]
    assert words[2:7] == [[3], [3], [4, 5], [6], [6]]  # "im" spells "in dem"
    assert words[11:] == [[11], []]  # the period is its own word; </s> belongs to none
    assert alignment.pieces_of_word[6] == [5, 6]


def test_bpe_pieces_unknown_pieces_and_lone_markers():
    tree = read_conllu(CONLLU)[0]
    bpe = "Max wart@@ et auf Ann@@ as Anruf@@ . </s>".split()
    assert [sorted(w) for w in align_pieces(bpe, tree).words_of_piece][1:3] == [[2], [2]]
    # a word-level model: "Anruf." is one piece spanning two words; <unk> matches "Annas"
    words = align_pieces("Max wartet auf <unk> Anruf. </s>".split(), tree).words_of_piece
    assert words[3] == {4} and words[4] == {5, 6}
    lone = align_pieces(["▁", "MAX", "▁wartet", "▁auf", "▁Annas", "▁Anruf", "."], tree)
    assert lone.words_of_piece[0] == {1} and lone.words_of_piece[1] == {1}  # case-insensitive


def test_other_characters_do_not_align():
    tree = read_conllu(CONLLU)[0]
    assert align_pieces("Max wartet nicht auf Annas Anruf. </s>".split(), tree) is None


def test_relation_pairs_both_directions_all_or_first_pieces():
    tree = DependencyTree(
        [Word(1, "Hunde", 2, "nsubj"), Word(2, "bellen", 0, "root")],
        [("Hunde", (1,)), ("bellen", (2,))],
    )
    alignment = align_pieces(["▁Hun", "de", "▁bellen", "</s>"], tree)
    pairs = {(p.query, p.key, p.direction) for p in relation_pairs(tree, alignment)}
    assert pairs == {
        (0, 2, "dependent->head"),
        (1, 2, "dependent->head"),
        (2, 0, "head->dependent"),
        (2, 1, "head->dependent"),
    }
    first = relation_pairs(tree, alignment, carrier="first")
    assert {(p.query, p.key) for p in first} == {(0, 2), (2, 0)}
    related = related_matrix(relation_pairs(tree, alignment), 4)
    assert related.equal(related.T) and not related[0, 1]  # pieces of one word: unrelated


def test_piece_words_rules():
    assert piece_words("▁Das ▁Hau s ▁ist </s>".split()) == [0, 1, 1, 2, None]
    assert piece_words("Das Hau@@ s ist </s>".split()) == [0, 1, 1, 2, None]
    assert piece_words("Das Haus ist".split()) == [0, 1, 2]
    assert sentence_positions("Das Haus </s>".split()) == [0, 1]


def test_token_sets_follow_pande():
    related = torch.zeros(7, 7, dtype=torch.bool)
    related[0, 6] = related[6, 0] = related[0, 1] = related[1, 0] = True
    sets = token_sets(7, related)
    assert sets["local"][3].tolist() == [False, True, True, True, True, True, False]
    assert sets["syntactic"][0].nonzero().flatten().tolist() == [6]  # (0, 1) is local already
    assert (sets["local"] | sets["syntactic"] | sets["unrelated"]).all()
    assert not (sets["local"] & sets["unrelated"]).any()
    assert set(token_sets(7)) == {"local", "nonlocal"}


def test_spacy_docs_become_trees():
    class Token:
        def __init__(self, i, text, head, dep):
            self.i, self.text, self.head, self.dep_ = i, text, self, dep
            self.head_index = head

    tokens = [Token(0, "Hunde", 1, "sb"), Token(1, "bellen", 1, "ROOT")]
    for token in tokens:
        token.head = tokens[token.head_index]
    (tree,) = trees_from_spacy([tokens])
    assert tree.arcs() == [(1, 2, "sb")] and tree.words[1].head == 0


def test_missing_spacy_or_model_is_a_clear_error():
    installed = importlib.util.find_spec("spacy") is not None
    message = "no such spaCy model" if installed else "spaCy is not installed"
    with pytest.raises(ValueError, match=f"--spacy-model xx_no_such_model: {message}"):
        parse_with_spacy(["Hunde bellen."], "xx_no_such_model")


def test_raw_text_through_a_sentencepiece_model_aligns_with_the_parse(tiny_data, tmp_path):
    """--source-text with --sentencepiece-model: pieces come from the spm model, ids from the
    dictionary, and the pieces align with the CoNLL-U words."""
    import sentencepiece
    from fairseq.data import Dictionary
    from fairseq.tasks.translation import TranslationConfig, TranslationTask

    source = tmp_path / "source.de"
    source.write_text("\n".join(SOURCE_LINES) + "\n", encoding="utf-8")
    corpus = tmp_path / "corpus.de"
    corpus.write_text((tiny_data / "small" / "train.de").read_text() + source.read_text())
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "spm"), vocab_size=300, minloglevel=2
    )
    processor = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "spm.model"))
    dictionary = Dictionary()
    for line in corpus.read_text().splitlines():
        for piece in processor.encode(line, out_type=str):
            dictionary.add_symbol(piece)
    task = TranslationTask(TranslationConfig(), dictionary, dictionary)
    loaded = LoadedModel(None, task, None, torch.device("cpu"))
    args = argparse.Namespace(
        source_text=str(source),
        target_text=None,
        sentencepiece_model=str(tmp_path / "spm.model"),
        max_sentences=None,
        conllu=str(CONLLU),
        spacy_model=None,
    )
    sentences = list(read_sentences(loaded, args, progress=False))
    assert [s.index for s in sentences] == [0, 1]
    assert (
        sentences[1].source_pieces[0].startswith("▁") and sentences[1].source_pieces[-1] == "</s>"
    )
    assert sentences[1].sample["net_input"]["src_tokens"].shape == (1, len(sentences[1].source))
    syntax = SourceSyntax.from_args(args)
    assert all(syntax.relations(s) for s in sentences)
    assert syntax.summary()["aligned_sentences"] == 2


def test_raw_text_errors_name_the_file_and_line(tmp_path):
    from fairseq.data import Dictionary

    from local_attn_fairseq.analysis.loading import encode_lines

    path = tmp_path / "source.de"
    path.write_text("Hunde bellen .\n\nKatzen auch .\n", encoding="utf-8")
    with pytest.raises(ValueError, match="source.de, line 2: empty line"):
        encode_lines(str(path), str.split, Dictionary())
