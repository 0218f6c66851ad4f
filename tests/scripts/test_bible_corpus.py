"""The Bible corpus: markup removal, verse parsing, alignment and book splits, on the real
SWORD modules that scripts/setup_env.sh installs (a few books: a few hundred verses)."""

import os
import re

import pytest

from local_attn_fairseq.data import bible

from ..conftest import run_script

SCRIPT = os.path.join("scripts", "prepare_bible.py")

MARKUP = re.compile(r"[<>]|strong:|savlm|\b[GH]\d{4}\b|sID|eID")


def test_clean_osis_keeps_the_words_and_drops_the_markup():
    raw = (
        '<title type="x-gen">A heading</title><w savlm="strong:H0430">God</w>'
        '<w savlm="strong:H1254">created</w> <q who="Jesus" marker="">“<w>Yes</w>,</q> '
        '<note type="x-footnote">or, a note</note><transChange type="added">es</transChange>'
        '<w savlm="strong:H2416"/> <l level="1" sID="x"/>Amen &amp; amen.<milestone type="line"/>'
    )
    assert bible.clean_osis(raw) == "God created “Yes, es Amen & amen."


def test_parse_verses_joins_lines_and_ignores_what_precedes_a_reference():
    text = (
        "Ruth 1:1: <w>In</w> <w>the days</w>\n"
        "  <l/>of the judges.\n"
        '<title canonical="true" type="psalm">A stale title.</title> <lg sID="g1"/>Ruth 1:2: '
        "<w>The man</w>.\n"
        "I John 1:1: <w>That which</w>\n"
        "(engWEB2015eb)\n"
    )
    assert bible.parse_verses(text) == {
        ("Ruth", 1, 1): "In the days of the judges.",
        ("Ruth", 1, 2): "The man.",
        ("I John", 1, 1): "That which",
    }


def test_align_pairs_references_and_drops_mismatched_verses():
    english = {("Ruth", 1, 2): "b b b", ("Ruth", 1, 1): "a a", ("Ruth", 1, 3): "x"}
    spanish = {("Ruth", 1, 1): "A A", ("Ruth", 1, 2): "B B B", ("Ruth", 1, 3): "y " * 9}
    assert bible.align(english, spanish) == [
        (("Ruth", 1, 1), "a a", "A A"),
        (("Ruth", 1, 2), "b b b", "B B B"),
    ]


def test_align_drops_chapters_numbered_differently_and_the_next_one():
    # Jonah 1:17 of one module is 2:1 of the other: chapter 2 is shifted by a verse
    english = {("Jonah", 1, 1): "a", ("Jonah", 1, 2): "fish", ("Jonah", 2, 1): "prayed"}
    english[("Jonah", 3, 1)] = "again"
    spanish = {("Jonah", 1, 1): "A", ("Jonah", 1, 2): "", ("Jonah", 2, 1): "pez"}
    spanish[("Jonah", 3, 1)] = "otra vez"
    assert bible.misnumbered_chapters(english, spanish) == {("Jonah", 1), ("Jonah", 2)}
    assert bible.align(english, spanish) == [(("Jonah", 3, 1), "again", "otra vez")]


def test_split_by_book_keeps_books_whole():
    pairs = [((book, 1, v), "e", "s") for book in ("Genesis", "Ruth", "Joshua") for v in (1, 2)]
    splits = bible.split_by_book(pairs, valid_books=("Ruth",), test_books=("Joshua",))
    assert {k: {p[0][0] for p in v} for k, v in splits.items()} == {
        "train": {"Genesis"},
        "valid": {"Ruth"},
        "test": {"Joshua"},
    }
    with pytest.raises(ValueError, match="held-out books"):
        bible.split_by_book(pairs, valid_books=("Ruth",), test_books=("Ruth",))


def test_real_modules_give_aligned_clean_verses():
    books = ("Ruth", "Jonah", "Philippians")
    pairs = bible.read_corpus(books)
    assert 200 < len(pairs) <= 85 + 48 + 104
    assert {ref[0] for ref, _, _ in pairs} == set(books)
    by_ref = {ref: (en, es) for ref, en, es in pairs}
    en, es = by_ref[("Ruth", 1, 16)]  # the same verse on both sides
    assert "where you go, I will go" in en and "donde quiera que tú fueres, iré yo" in es
    en, es = by_ref[("Philippians", 4, 13)]
    assert "I can do all things through Christ" in en and "Todo lo puedo en Cristo" in es
    # Jonah 1:17 is the Spanish module's 2:1: both chapters are left out, chapters 3-4 kept
    assert {ref[1] for ref in by_ref if ref[0] == "Jonah"} == {3, 4}
    for ref, en, es in pairs:
        assert en and es and not MARKUP.search(en) and not MARKUP.search(es), ref
        assert "  " not in en + es
    with pytest.raises(ValueError, match="unknown books"):
        bible.read_corpus(["Hezekiah"])


def test_verses_in_order_read_one_module_as_running_text():
    """The language-model demo's text: Malachi ends at its own last verse (asked for a range,
    diatheke would run the deuterocanonical books into it) and Revelation without the WEB's
    glossary, which the module keeps inside its last verse."""
    verses = bible.verses_in_order(books=("Revelation of John", "Malachi"))
    references = [ref for ref, _ in verses]
    assert references[0] == ("Malachi", 1, 1) and references == sorted(
        references, key=lambda ref: (ref[0] != "Malachi", ref[1], ref[2])
    )
    text = dict(verses)
    assert text[("Malachi", 4, 6)].endswith("strike the earth with a curse.”")
    assert text[("Revelation of John", 22, 21)] == (
        "The grace of the Lord Jesus Christ be with all the saints. Amen."
    )
    assert all(t and not MARKUP.search(t) for _, t in verses)
    with pytest.raises(ValueError, match="unknown books"):
        bible.verses_in_order(books=("Tobit",))


def test_prepare_bible_writes_book_disjoint_splits(tmp_path):
    out = tmp_path / "raw"
    books = "Genesis,Ruth,Jonah,Philippians,Romans"
    proc = run_script(
        SCRIPT, "--out-dir", out, "--books", books, "--max-train", "300", "--test-size", "100",
        separate_process=True,  # once as its own process; the other cases in this one
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"verse pairs \(train 300, valid \d+, test 100\)", proc.stdout), proc.stdout
    books_in = {}
    for split in ("train", "valid", "test"):
        lines = {lang: (out / f"{split}.{lang}").read_text().splitlines() for lang in ("en", "es", "ref")}
        assert len(lines["en"]) == len(lines["es"]) == len(lines["ref"])
        books_in[split] = {ref.rsplit(" ", 1)[0] for ref in lines["ref"]}
    assert books_in == {"train": {"Genesis"}, "valid": {"Ruth", "Jonah", "Philippians"}, "test": {"Romans"}}
    # a selection without a held-out book for a split is refused, naming the books to add
    proc = run_script(SCRIPT, "--out-dir", tmp_path / "none", "--books", "Genesis")
    assert proc.returncode == 2 and "--books: no verse pairs for valid, test" in proc.stderr
    assert not (tmp_path / "none").exists()  # refused before anything is written


def test_prepare_bible_refuses_a_folder_it_did_not_create(tmp_path):
    (tmp_path / "train.en").write_text("a user's own file\n")
    proc = run_script(SCRIPT, "--out-dir", tmp_path, "--books", "Ruth,Romans")
    assert proc.returncode != 0 and "--overwrite" in proc.stderr
    assert (tmp_path / "train.en").read_text() == "a user's own file\n"


def test_prepare_bible_reports_an_unwritable_out_dir_in_one_line(tmp_path):
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "out"  # under a regular file: not writable, even for root
    proc = run_script(
        SCRIPT, "--out-dir", out, "--books", "Ruth,Romans,Jude", "--max-train", "5",
        "--test-size", "5",
    )  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == f"error: --out-dir: {out}: Not a directory"
    assert os.listdir(tmp_path) == ["a_file"]
