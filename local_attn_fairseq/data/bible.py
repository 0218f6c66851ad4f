"""The English-Spanish Bible corpus: public-domain translations in Debian's SWORD modules.

English is the World English Bible (``sword-text-web``, module engWEB2015eb), Spanish the
Reina-Valera 1909 (``sword-text-sparv``, module spaRV1909eb); both are in the public domain.
``diatheke`` (Debian's SWORD front end) prints every verse of a module with its reference; the
OSIS markup (Strong's numbers, poetry lines, red letters, headings, notes) is removed here,
verses are paired by (book, chapter, verse), and whole books go to validation and test so that
no verse, nor any other verse of its book, is seen in training. The split files are replaced as
one set (``text.write_split_set``), so an interrupted run never leaves splits of two runs.
"""

import argparse
import html
import re
import shutil
import statistics
import subprocess
import sys

from ..cli_types import positive_int
from ..file_safety import check_output_dir, claim_output_dir, exit_on_os_error
from .text import lines_text, write_split_set

ENGLISH_MODULE = "engWEB2015eb"
SPANISH_MODULE = "spaRV1909eb"
# The owner named in the folders it writes; the script's name, so folders written earlier stay ours.
TOOL = "scripts/prepare_bible.py"
INSTALL_HINT = "install them with 'apt-get install diatheke sword-text-web sword-text-sparv'"

# The 66 books both translations share, as diatheke's English locale names them, in order.
# The English module's deuterocanonical books have no Spanish counterpart and are left out.
BOOKS = (
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth",
    "I Samuel", "II Samuel", "I Kings", "II Kings", "I Chronicles", "II Chronicles", "Ezra",
    "Nehemiah", "Esther", "Job", "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon",
    "Isaiah", "Jeremiah", "Lamentations", "Ezekiel", "Daniel", "Hosea", "Joel", "Amos",
    "Obadiah", "Jonah", "Micah", "Nahum", "Habakkuk", "Zephaniah", "Haggai", "Zechariah",
    "Malachi", "Matthew", "Mark", "Luke", "John", "Acts", "Romans", "I Corinthians",
    "II Corinthians", "Galatians", "Ephesians", "Philippians", "Colossians", "I Thessalonians",
    "II Thessalonians", "I Timothy", "II Timothy", "Titus", "Philemon", "Hebrews", "James",
    "I Peter", "II Peter", "I John", "II John", "III John", "Jude", "Revelation of John",
)  # fmt: skip
# Held-out books: narrative and letters with no parallel passage elsewhere in the Bible (the
# Gospels, Kings/Chronicles and Samuel retell each other, so none of them is held out).
VALID_BOOKS = ("Ruth", "Jonah", "Philippians", "Colossians")
TEST_BOOKS = ("Joshua", "Romans")
# A pair whose sides differ more than this in length is a verse the two versifications split
# differently (a psalm title counted as verse 1 in one of them, say), not a translation.
MAX_LENGTH_RATIO = 2.5

_REFERENCE = re.compile(
    r"(?:^|>)\s*(?P<book>"
    + "|".join(re.escape(b) for b in BOOKS)
    + r") (?P<chapter>\d+):(?P<verse>\d+): "
)
# Elements whose text is not verse text: headings, psalm titles kept apart, notes, cross references.
_DROPPED_ELEMENTS = re.compile(r"<(title|note|reference)\b[^>]*?(?<!/)>.*?</\1>", re.S)
# Inline elements sit inside or around words: removing them must not split or join words.
_INLINE_TAG = re.compile(r"</?(w|transChange|seg|hi|foreign|name|divineName|rdg)\b[^>]*>")
# Two word elements with nothing between them are still two words (the WEB has "God</w><w>created").
_ADJACENT_WORDS = re.compile(r"</w>(?=<w[\s>/])")
_ANY_TAG = re.compile(r"<[^>]*>")
# A book's closing element and whatever follows it in the same verse: the WEB module keeps its
# glossary after the end of Revelation, inside Revelation 22:21.
_AFTER_BOOK_END = re.compile(r'<div\b(?=[^>]*\beID=)(?=[^>]*\btype="book")[^>]*/>.*', re.S)
_SPACES = re.compile(r"\s+")
_SPACE_BEFORE_PUNCTUATION = re.compile(r" +([,.;:!?»”’)])")


class CorpusUnavailable(RuntimeError):
    """diatheke or one of the SWORD modules is not installed."""


def module_text(module, books=None):
    """Every verse of `module` (or of `books` only) as diatheke prints it: ``Book C:V: <OSIS
    text>`` lines."""
    diatheke = shutil.which("diatheke")
    if diatheke is None:
        raise CorpusUnavailable(f"diatheke is not installed; {INSTALL_HINT}")
    proc = subprocess.run(
        [diatheke, "-b", module, "-k", ";".join(books) if books else "Gen-Rev"],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0 or _REFERENCE.search(proc.stdout) is None:
        raise CorpusUnavailable(
            f"diatheke could not read the SWORD module {module} "
            f"({(proc.stderr or proc.stdout).strip()[:200]!r}); {INSTALL_HINT}"
        )
    return proc.stdout


def clean_osis(text):
    """Plain verse text from OSIS markup: headings and notes dropped, tags removed."""
    text = _DROPPED_ELEMENTS.sub(" ", text)
    text = _ADJACENT_WORDS.sub(" ", text)
    text = _INLINE_TAG.sub("", text)
    text = _ANY_TAG.sub(" ", text)
    text = html.unescape(text)
    text = _SPACES.sub(" ", text).strip()
    return _SPACE_BEFORE_PUNCTUATION.sub(r"\1", text)


def parse_verses(text, clean=clean_osis):
    """{(book, chapter, verse): plain text} from diatheke's output of a whole module.

    A verse may span several lines; whatever precedes a reference on its line (diatheke
    repeats a stale heading before some verses) is not part of any verse. ``clean`` makes a
    verse's OSIS plain text.
    """
    verses, key, parts = {}, None, []

    def close():
        if key is not None:
            verses[key] = clean(" ".join(parts))

    for line in text.splitlines():
        if line.startswith("(") and line.strip().strip("()") in (ENGLISH_MODULE, SPANISH_MODULE):
            continue  # diatheke's closing line naming the module
        match = _REFERENCE.search(line)
        if match is None:
            parts.append(line)
            continue
        close()
        key = (match["book"], int(match["chapter"]), int(match["verse"]))
        parts = [line[match.end() :]]
    close()
    return verses


def misnumbered_chapters(english, spanish):
    """Chapters whose verses the two modules number differently, and the chapters after them.

    The modules follow different versifications (NRSVA, KJV) and the Spanish one leaves some
    verses empty where its text moved the verse elsewhere (Jonah 1:17 is its Jonah 2:1): where
    the translated verse numbers of a chapter differ, its pairs and those of the next chapter,
    which such a shift runs into, are not translations of each other.
    """
    numbers = {}
    for side, verses in enumerate((english, spanish)):
        for (book, chapter, verse), text in verses.items():
            translated = numbers.setdefault((book, chapter), (set(), set()))[side]
            translated.update([verse] if text else [])
    differ = {chapter for chapter, (en, es) in numbers.items() if en != es}
    return differ | {(book, chapter + 1) for book, chapter in differ}


def align(english, spanish):
    """[(reference, english, spanish)] in canonical order, for references both sides translate."""
    order = {book: i for i, book in enumerate(BOOKS)}
    skipped = misnumbered_chapters(english, spanish)
    pairs = []
    for ref in sorted(english.keys() & spanish.keys(), key=lambda r: (order[r[0]], r[1], r[2])):
        if ref[:2] in skipped:
            continue
        en, es = english[ref], spanish[ref]
        if not en or not es:
            continue  # a verse neither translation has
        n_en, n_es = len(en.split()), len(es.split())
        if max(n_en, n_es) > MAX_LENGTH_RATIO * min(n_en, n_es):
            continue
        pairs.append((ref, en, es))
    return pairs


def split_by_book(pairs, valid_books=VALID_BOOKS, test_books=TEST_BOOKS, max_train=None):
    """{"train", "valid", "test": [pair]}: the held-out books whole, the rest for training."""
    unknown = set(valid_books + test_books) - set(BOOKS)
    if unknown or set(valid_books) & set(test_books):
        raise ValueError(f"held-out books must be distinct names from BOOKS: {sorted(unknown)}")
    splits = {"train": [], "valid": [], "test": []}
    for pair in pairs:
        book = pair[0][0]
        name = "valid" if book in valid_books else "test" if book in test_books else "train"
        splits[name].append(pair)
    if max_train is not None:
        splits["train"] = splits["train"][:max_train]
    return splits


def read_corpus(books=None):
    """The aligned pairs of the installed modules, of every book or of `books` only."""
    unknown = set(books or ()) - set(BOOKS)
    if unknown:
        raise ValueError(f"unknown books {sorted(unknown)}; the names are those of BOOKS")
    english, spanish = (
        parse_verses(module_text(module, books)) for module in (ENGLISH_MODULE, SPANISH_MODULE)
    )
    return align(english, spanish)


def verses_in_order(module=ENGLISH_MODULE, books=BOOKS):
    """[(reference, text)] of one module's verses of ``books`` (names of BOOKS), in canonical
    order: the Bible as one running text, for a language model. Only these books are asked of
    diatheke (asked for a range, it runs the deuterocanonical books, whose references are not
    matched, into Malachi 4:6); what follows the end of a book (the WEB's glossary) and the
    verses the module leaves empty are left out."""
    unknown = set(books) - set(BOOKS)
    if unknown:
        raise ValueError(f"unknown books {sorted(unknown)}; the names are those of BOOKS")

    def clean(osis):
        return clean_osis(_AFTER_BOOK_END.sub("", osis))

    verses = parse_verses(module_text(module, books), clean)
    order = {book: i for i, book in enumerate(BOOKS)}
    ordered = sorted(verses, key=lambda ref: (order[ref[0]], ref[1], ref[2]))
    return [(ref, verses[ref]) for ref in ordered if verses[ref]]


def write_splits(splits, out_dir, source="en", target="es"):
    """``{split}.{source}``/``{split}.{target}`` plus ``{split}.ref`` (the verse references) into
    ``out_dir`` (claimed by `TOOL`), the set of files replaced as one (``text.write_split_set``)."""
    files = {}
    for name, pairs in splits.items():
        columns = {
            source: [en for _, en, _ in pairs],
            target: [es for _, _, es in pairs],
            "ref": [f"{book} {chapter}:{verse}" for (book, chapter, verse), _, _ in pairs],
        }
        for suffix, lines in columns.items():
            files[f"{name}.{suffix}"] = lines_text(lines)
    write_split_set(files, out_dir, TOOL)


def describe(splits):
    """Sizes for the logs and the README: pairs per split, mean words per sentence."""
    pairs = [p for split in splits.values() for p in split]
    sizes = ", ".join(f"{name} {len(split)}" for name, split in splits.items())
    en, es = (
        statistics.mean(len(p[side].split()) for p in pairs) if pairs else 0.0 for side in (1, 2)
    )
    return f"{len(pairs)} verse pairs ({sizes}), mean words per verse: en {en:.1f}, es {es:.1f}"


def main(argv=None):
    """``scripts/prepare_bible.py``: write ``{train,valid,test}.{en,es,ref}`` into --out-dir."""
    parser = argparse.ArgumentParser(
        description="Extract English-Spanish verse pairs from Debian's public-domain SWORD "
        "Bibles (World English Bible, Reina-Valera 1909), whole books held out for valid/test."
    )
    parser.add_argument("--out-dir", required=True, help="directory for {train,valid,test}.{en,es}")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into an --out-dir that holds other files (their split files are replaced)",
    )
    parser.add_argument("--max-train", type=positive_int, help="keep the first N training pairs")
    parser.add_argument("--valid-size", type=positive_int, help="keep the first N validation pairs")
    parser.add_argument("--test-size", type=positive_int, help="keep the first N test pairs")
    parser.add_argument(
        "--books",
        help="comma-separated books to read instead of the whole Bible (quick runs); "
        "the held-out books among them still go to valid/test",
    )
    args = parser.parse_args(argv)
    books = args.books.split(",") if args.books else None
    with exit_on_os_error("--out-dir"):  # refused before diatheke reads the corpus
        check_output_dir(args.out_dir, TOOL, args.overwrite)
    try:
        splits = split_by_book(read_corpus(books), max_train=args.max_train)
    except (CorpusUnavailable, ValueError) as error:
        sys.exit(f"error: {error}")
    for name, size in (("valid", args.valid_size), ("test", args.test_size)):
        splits[name] = splits[name][:size]
    empty = [name for name, pairs in splits.items() if not pairs]
    if empty:
        parser.error(
            f"--books: no verse pairs for {', '.join(empty)}: --books must include a held-out "
            f"book for each split (valid: {', '.join(VALID_BOOKS)}; "
            f"test: {', '.join(TEST_BOOKS)}) and a book for training"
        )
    with exit_on_os_error("--out-dir"):
        claim_output_dir(args.out_dir, TOOL, args.overwrite)
        write_splits(splits, args.out_dir)
    print(f"| Bible en-es: {describe(splits)} -> {args.out_dir}")


if __name__ == "__main__":
    main()
