"""The Bible's English spoken by espeak-ng (``synthesize_speech_corpus.py --corpus bible-en-es``):
MuST-C's en-es layout, a held-out voice for dev and tst-COMMON, verse references beside the
text, runs that resume where an interrupted one stopped, and fairseq preparation of the result.

A few books (a few hundred verses read by diatheke), 24 + 6 + 6 verses of at most 12 words
spoken, two per talk, built once for the module."""

import csv
import os
import shutil

import pytest

from local_attn_fairseq.data import bible
from local_attn_fairseq.data import speech_corpus as synthesize_speech_corpus
from local_attn_fairseq.file_safety import OWNER_MARKER

from ..conftest import REPO, run_script, snapshot
from .speech_corpus import SCRIPTS, needs_diatheke, needs_espeak
from .speech_corpus import read_split as shared_read_split
from .speech_corpus import split_dir as shared_split_dir

SYNTHESIZER = os.path.relpath(os.path.join(SCRIPTS, "synthesize_speech_corpus.py"), REPO)
pytestmark = [needs_espeak, needs_diatheke]

# Genesis for training, a dev book and a test book with verses of at most 12 words.
BOOKS = ("Genesis", "Philippians", "Joshua")
SIZES = {"train": 24, "dev": 6, "tst-COMMON": 6}
OPTIONS = (
    "--corpus", "bible-en-es", "--books", ",".join(BOOKS), "--max-words", 12,
    "--train-size", SIZES["train"], "--dev-size", SIZES["dev"], "--test-size", SIZES["tst-COMMON"],
    "--utterances-per-talk", 2, "--workers", 2,
)  # fmt: skip
HELD_OUT = ("en-us-nyc", "f5")  # the corpus's default held-out voice


def synthesize(out_dir, *extra):
    """The script, as a user runs it (in this process: tests/conftest.py run_script)."""
    return run_script(SYNTHESIZER, "--out-dir", out_dir, *OPTIONS, *extra)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(root holding en-es/data/..., what the script printed)."""
    root = tmp_path_factory.mktemp("bible_speech")
    proc = synthesize(root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, proc.stdout


@pytest.fixture
def corpus_copy(corpus, tmp_path):
    return shutil.copytree(corpus[0], tmp_path / "corpus")  # copies keep their mtimes


def split_dir(root, split):
    return shared_split_dir(root, split, "en-es")


def read_split(root, split):
    return shared_read_split(root, split, "en-es", ("en", "es", "ref"))


def mtimes(folder):
    return {name: os.stat(folder / name).st_mtime_ns for name in os.listdir(folder)}


def voice(segment):
    _, accent, variant = segment["speaker_id"].split(".")
    return accent, variant


# ---------------------------------------------------------------- the corpus


def test_bible_corpus_has_mustc_en_es_layout_and_line_counts(corpus):
    root, log = corpus
    assert "| train: 24 utterances in 12 talks" in log
    assert f"| synthetic MuST-C en-es -> {root / 'en-es'}" in log
    for split, size in SIZES.items():
        segments, lines = read_split(root, split)
        assert len(segments) == len(lines["en"]) == len(lines["es"]) == len(lines["ref"]) == size
        assert len(os.listdir(split_dir(root, split) / "wav")) == size // 2
        for segment, en in zip(segments, lines["en"]):
            assert int(segment["rW"]) == len(en.split()) <= 12
    talks = [s["wav"] for split in SIZES for s in read_split(root, split)[0]]
    assert talks[::2] == [f"ted_{i}.wav" for i in range(1, 19)]  # numbered across the splits


def test_held_out_voice_alone_speaks_dev_and_test(corpus):
    root, _ = corpus
    train_voices = {voice(s) for s in read_split(root, "train")[0]}
    assert len(train_voices) > 1
    assert all(accent != HELD_OUT[0] and variant != HELD_OUT[1] for accent, variant in train_voices)
    for split in ("dev", "tst-COMMON"):
        assert {voice(s) for s in read_split(root, split)[0]} == {HELD_OUT}


def test_translations_and_references_sit_beside_their_verses(corpus):
    root, _ = corpus
    pairs = bible.read_corpus(BOOKS)
    by_reference = {f"{b} {c}:{v}": (en, es) for (b, c, v), en, es in pairs}
    short = [f"{b} {c}:{v}" for (b, c, v), en, _ in pairs if len(en.split()) <= 12]
    books = {"train": {"Genesis"}, "dev": set(bible.VALID_BOOKS), "tst-COMMON": {"Joshua"}}
    for split in SIZES:
        _, lines = read_split(root, split)
        for en, es, reference in zip(lines["en"], lines["es"], lines["ref"]):
            assert (en, es) == by_reference[reference]
        assert {ref.rsplit(" ", 1)[0] for ref in lines["ref"]} <= books[split]
        # the first short verses of the split's books, in canonical order
        in_books = [ref for ref in short if ref.rsplit(" ", 1)[0] in books[split]]
        assert lines["ref"] == in_books[: SIZES[split]]
    _, lines = read_split(root, "train")
    assert lines["ref"][0] == "Genesis 1:1"
    assert lines["es"][0] == "EN el principio crió Dios los cielos y la tierra."


def test_mustc_preparation_reads_the_corpus_with_lang_es(corpus, tmp_path):
    from local_attn_fairseq.data import mustc

    root, _ = corpus
    out = tmp_path / "prepared"
    mustc.main(
        ["--mustc-root", str(root), "--lang", "es", "--out-dir", str(out), "--vocab-size", "100",
         "--workers", "1"]
    )  # fmt: skip
    for split, size in SIZES.items():
        _, lines = read_split(root, split)
        for task, lang in (("asr", "en"), ("st", "es")):
            with open(out / f"{split}_{task}.tsv", encoding="utf-8") as f:
                rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
            assert len(rows) == size
            assert sorted(r["tgt_text"] for r in rows) == sorted(lines[lang])
    assert (out / "config_st.yaml").is_file() and (out / "spm_unigram100_st.model").is_file()


# ---------------------------------------------------------------- resuming


def test_an_interrupted_corpus_is_resumed_to_the_same_bytes(corpus, corpus_copy):
    original, _ = corpus
    train = split_dir(corpus_copy, "train")
    # what a run killed while speaking ted_3 leaves: no wav, no segments, no yaml yet, and
    # the temporary file of a half-written wav
    (train / "wav" / "ted_3.wav").unlink()
    (train / "segments" / "ted_3.json").unlink()
    (train / "txt" / "train.yaml").unlink()
    (train / "wav" / ".ted_3.wav.0123abcd.tmp").write_bytes(b"RIFF half a talk")
    before = mtimes(train / "wav")
    proc = synthesize(corpus_copy)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| train: 11 of 12 talks spoken by an earlier run" in proc.stdout
    assert snapshot(corpus_copy) == snapshot(original)
    after = mtimes(train / "wav")
    assert {n for n in after if after[n] != before.get(n)} == {"ted_3.wav"}  # only it re-spoken
    # a finished corpus with the same settings: nothing spoken again
    proc = synthesize(corpus_copy)
    assert "| tst-COMMON: 3 of 3 talks spoken by an earlier run" in proc.stdout
    assert mtimes(train / "wav") == after and snapshot(corpus_copy) == snapshot(original)


def test_changed_settings_replace_the_splits(corpus_copy, monkeypatch):
    monkeypatch.setattr(synthesize_speech_corpus, "PROGRESS_SECONDS", 0)  # a line per talk
    train = split_dir(corpus_copy, "train")
    (train / "wav" / "ted_99.wav").write_bytes(b"left over from an earlier run")
    proc = synthesize(corpus_copy, "--held-out-voice", "en-gb+m1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "spoken by an earlier run" not in proc.stdout
    assert "| train: 11 of 12 talks" in proc.stdout  # progress
    assert sorted(os.listdir(train / "wav")) == sorted(f"ted_{i}.wav" for i in range(1, 13))
    train_voices = {voice(s) for s in read_split(corpus_copy, "train")[0]}
    assert all(accent != "en-gb" and variant != "m1" for accent, variant in train_voices)
    for split in ("dev", "tst-COMMON"):
        assert {voice(s) for s in read_split(corpus_copy, split)[0]} == {("en-gb", "m1")}


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--held-out-voice", "en-us-nyc"), "--held-out-voice: expected ACCENT+VARIANT"),
        (("--held-out-voice", "en-us+f9"), "VARIANT one of m1, m2,"),
        (("--held-out-voice", "en-au+m1"), "got 'en-au+m1'"),
        (("--pairs-dir", "ding"), "--pairs-dir is an option of --corpus ding-de-en"),
    ],
)
def test_bad_options_are_refused_before_any_work(tmp_path, extra, message):
    proc = synthesize(tmp_path / "out", *extra)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert os.listdir(tmp_path) == []


def test_a_size_larger_than_the_books_have_is_refused_with_the_numbers(tmp_path):
    short = [p for p in bible.read_corpus(["Genesis"]) if len(p[1].split()) <= 12]
    proc = synthesize(tmp_path / "out", "--train-size", 100_000)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"error: --train-size 100,000: only {len(short):,} train verses of at most 12 words "
        "in --books"
    )
    proc = synthesize(tmp_path / "out", "--books", "Genesis,Joshua")
    assert proc.stderr.splitlines()[-1].startswith(
        "error: no dev verses (Ruth, Jonah, Philippians, Colossians) of at most 12 words in "
        "--books: --books must include one of those books"
    )
    assert os.listdir(tmp_path) == []  # refused before anything is written


def test_missing_diatheke_is_the_bible_modules_message(tmp_path):
    espeak_only = tmp_path / "bin"
    espeak_only.mkdir()
    os.symlink(shutil.which("espeak-ng"), espeak_only / "espeak-ng")
    proc = run_script(SYNTHESIZER, "--out-dir", tmp_path / "out", *OPTIONS,
                      env={"PATH": str(espeak_only)})  # fmt: skip
    assert proc.returncode == 1 and proc.stderr.splitlines()[-1] == (
        f"error: diatheke is not installed; {bible.INSTALL_HINT}"
    )


def test_a_foreign_split_folder_is_refused_even_with_overwrite(tmp_path):
    user_file = tmp_path / "MUSTC_v1.0" / "en-es" / "data" / "dev" / "wav" / "ted_1.wav"
    user_file.parent.mkdir(parents=True)
    user_file.write_bytes(b"RIFF real talk")
    proc = synthesize(tmp_path / "MUSTC_v1.0", "--overwrite")
    assert proc.returncode == 1 and "was not written by synthesize_speech_corpus" in proc.stderr
    assert user_file.read_bytes() == b"RIFF real talk"
    assert not (tmp_path / "MUSTC_v1.0" / OWNER_MARKER).exists()  # refused before any writing
