"""Speak the English side of a parallel corpus: a synthetic speech corpus in MuST-C's layout.

Two corpora (``--corpus``): ``ding-de-en``, the German-English sentence pairs of Debian's Ding
dictionary (``ding.py``), and ``bible-en-es``, the English-Spanish verse pairs of Debian's
public-domain SWORD Bibles (``bible.py``: World English Bible, Reina-Valera 1909), whose held-out
books become dev (Ruth, Jonah, Philippians, Colossians) and tst-COMMON (Joshua, Romans). Debian's
``espeak-ng`` reads the English side aloud; the other side is the translation. Each talk gets one
speaker (an English accent and a voice variant) and each utterance its own speed and pitch, all
drawn from an RNG keyed by the seed, the split and the talk, so the corpus is the same for a
given seed whatever the number of workers and however often a run was interrupted. With a
held-out voice (``--held-out-voice ACCENT+VARIANT``; the Bible's default ``en-us-nyc+f5``), dev
and tst-COMMON are spoken by that voice alone and training talks by the other accents and
variants, so the test measures a speaker the model never heard. Audio is resampled to 16 kHz
mono 16-bit WAV. The output is laid out as MuST-C is::

    OUT/en-TGT/data/{train,dev,tst-COMMON}/wav/ted_<N>.wav
    OUT/en-TGT/data/<split>/txt/<split>.{yaml,en,TGT}     (and <split>.ref for the Bible)

``<split>.yaml`` has one line per segment,
``- {duration: D, offset: O, rW: words, uW: 0, speaker_id: spk.ACCENT.VARIANT, wav: ted_N.wav}``,
aligned with the lines of ``<split>.en`` and ``<split>.TGT`` (and of ``<split>.ref``, the
``Book chapter:verse`` each Bible segment comes from). With ``--utterances-per-talk K`` a talk
wav holds K utterances separated by pauses, and the segments carry their offsets, as real
MuST-C talks do.

A run can be interrupted and started again: each talk's wav is written whole (a temporary name,
then a rename), then its segments into ``<split>/segments/ted_N.json``; ``<split>/synthesis.json``
records what the split's audio depends on (corpus, texts, seed, voices, espeak-ng's version). A
split folder with the same record keeps the talks it has and speaks only the missing ones; the
yaml (from the segment files) and the text files are written once every talk is there. A split
folder with another record is spoken again from scratch.

The script never removes what it did not write: ``--out-dir`` must be empty, new, or an earlier
output of this script (whose split folders it then resumes or replaces); ``--overwrite`` lets it
write into another folder, e.g. a MuST-C root holding other language pairs, but a split folder
it did not create is still refused, never replaced.
"""

import argparse
import hashlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing import Pool
from typing import Callable, NamedTuple, Optional

import numpy as np
import soundfile as sf

from . import bible, ding
from ..cli_types import non_negative_int, positive_int
from ..file_safety import (
    FolderNotOwned,
    atomic_output,
    atomic_write_text,
    check_output_dir,
    claim_output_dir,
    exit_on_os_error,
    remove_leftover_temporaries,
    replace_own_dir,
)

TOOL = "synthesize_speech_corpus"

SAMPLE_RATE = 16_000
# MuST-C split name -> the split its pairs come from (Ding's and the Bible's names agree).
SPLITS = {"train": "train", "dev": "valid", "tst-COMMON": "test"}
SIZE_OPTIONS = {"train": "--train-size", "dev": "--dev-size", "tst-COMMON": "--test-size"}
# espeak-ng's own English voices (the MBROLA ones need voice data Debian does not ship with it).
ACCENTS = [
    "en-us", "en-gb", "en-gb-scotland", "en-gb-x-gbclan", "en-gb-x-rp", "en-gb-x-gbcwmd",
    "en-029", "en-us-nyc",
]  # fmt: skip
VARIANTS = ["m1", "m2", "m3", "m4", "m5", "m6", "m7", "f1", "f2", "f3", "f4", "f5"]
WORDS_PER_MINUTE = (135, 185)
PITCH = (25, 75)
PAUSE_SECONDS = (0.3, 0.9)  # between the utterances of one talk
SETTINGS_FILE = "synthesis.json"  # in a split folder: what its audio depends on
SEGMENTS_DIR = "segments"  # in a split folder: ted_N.json, the segments of each finished talk
PROGRESS_SECONDS = 60  # a progress line at most this often


class Utterance(NamedTuple):
    english: str  # spoken
    translation: str
    reference: Optional[str] = None  # where the pair comes from ("Ruth 1:16"), for tracing


class Voices(NamedTuple):
    """The accents and variants a split's talks draw their speaker from."""

    accents: tuple
    variants: tuple


@dataclass(frozen=True)
class Talk:
    """One talk wav to speak: everything a worker needs, nothing it must look up."""

    seed: int
    split: str
    index: int  # within the split: keys the talk's RNG
    wav_path: str
    segments_path: str
    sentences: tuple
    voices: Voices


# ---------------------------------------------------------------- speaking


def talk_rng(seed, split, talk_index):
    # A string seed is hashed deterministically, so each talk's draws are independent of the
    # order in which workers pick talks up, and of which talks an earlier run already spoke.
    return random.Random(f"{seed}/{split}/{talk_index}")


def speak(text, voice, words_per_minute, pitch):
    """One utterance as float32 samples at 16 kHz, spoken by espeak-ng."""
    import torch
    import torchaudio.functional as AF

    cmd = ["espeak-ng", "-v", voice, "-s", str(words_per_minute), "-p", str(pitch), "--stdout"]
    proc = subprocess.run(cmd, input=text.encode("utf-8"), capture_output=True)
    if proc.returncode != 0 or not proc.stdout:
        raise RuntimeError(
            f"espeak-ng failed for voice {voice} on {text!r}: {proc.stderr.decode()[-500:]}"
        )
    samples, rate = sf.read(io.BytesIO(proc.stdout), dtype="float32", always_2d=True)
    mono = torch.from_numpy(samples.mean(axis=1))
    return AF.resample(mono, rate, SAMPLE_RATE).numpy()


def synthesize_talk(talk):
    """Write one talk wav, then its segments' yaml fields (the sign that the talk is done)."""
    import torch

    torch.set_num_threads(1)  # the workers already share the cores
    rng = talk_rng(talk.seed, talk.split, talk.index)
    accent, variant = rng.choice(talk.voices.accents), rng.choice(talk.voices.variants)
    pieces, segments, position = [], [], 0
    for i, sentence in enumerate(talk.sentences):
        if i > 0:
            pause = np.zeros(int(rng.uniform(*PAUSE_SECONDS) * SAMPLE_RATE), dtype=np.float32)
            pieces.append(pause)
            position += len(pause)
        audio = speak(
            sentence, f"{accent}+{variant}", rng.randint(*WORDS_PER_MINUTE), rng.randint(*PITCH)
        )
        pieces.append(audio)
        segments.append(
            {
                "duration": len(audio) / SAMPLE_RATE,
                "offset": position / SAMPLE_RATE,
                "rW": len(sentence.split()),
                "uW": 0,
                "speaker_id": f"spk.{accent}.{variant}",
                "wav": os.path.basename(talk.wav_path),
            }
        )
        position += len(audio)
    waveform = np.clip(np.concatenate(pieces), -1.0, 1.0)
    with atomic_output(talk.wav_path) as partial:  # its name does not say WAV: format= does
        sf.write(partial, waveform, SAMPLE_RATE, format="WAV", subtype="PCM_16")
    atomic_write_text(talk.segments_path, json.dumps(segments))


def is_spoken(talk):
    # The segments file is written after the wav: with both there, the talk is whole.
    return os.path.isfile(talk.segments_path) and os.path.isfile(talk.wav_path)


def speak_missing_talks(split, talks, pool):
    """Speak the talks an earlier run did not finish, with a progress line now and then."""
    missing = [talk for talk in talks if not is_spoken(talk)]
    done = len(talks) - len(missing)
    if done:
        print(f"| {split}: {done:,} of {len(talks):,} talks spoken by an earlier run", flush=True)
    last_report = time.monotonic()
    for _ in pool.imap_unordered(synthesize_talk, missing):
        done += 1
        if time.monotonic() - last_report >= PROGRESS_SECONDS and done < len(talks):
            print(f"| {split}: {done:,} of {len(talks):,} talks", flush=True)
            last_report = time.monotonic()


# ---------------------------------------------------------------- voices


def held_out_voice(text):
    """argparse type of --held-out-voice: ``none`` or ACCENT+VARIANT of ACCENTS and VARIANTS."""
    accent, plus, variant = text.partition("+")
    if text != "none" and not (plus and accent in ACCENTS and variant in VARIANTS):
        raise argparse.ArgumentTypeError(
            f"expected ACCENT+VARIANT (or none), ACCENT one of {', '.join(ACCENTS)}, VARIANT "
            f"one of {', '.join(VARIANTS)}; got {text!r}"
        )
    return text


def voices_by_split(held_out):
    """{MuST-C split: Voices}. With a held-out ``ACCENT+VARIANT``, dev and tst-COMMON have that
    voice alone and training neither its accent nor its variant, so no training talk sounds
    like the test speaker."""
    everyone = Voices(tuple(ACCENTS), tuple(VARIANTS))
    if held_out == "none":
        return {split: everyone for split in SPLITS}
    accent, variant = held_out.split("+")
    others = Voices(
        tuple(a for a in ACCENTS if a != accent), tuple(v for v in VARIANTS if v != variant)
    )
    alone = Voices((accent,), (variant,))
    return {"train": others, "dev": alone, "tst-COMMON": alone}


# ---------------------------------------------------------------- the corpora's pairs


def short_enough(english, max_words):
    return not max_words or len(english.split()) <= max_words


def read_pairs_dir(pairs_dir, name, limit, max_words):
    """The first ``limit`` pairs of ``pairs_dir/name.{de,en}`` (files written by prepare_ding)."""
    sides = []
    for lang in ("de", "en"):
        path = os.path.join(pairs_dir, f"{name}.{lang}")
        if not os.path.exists(path):
            sys.exit(f"error: {path} not found (write it with scripts/prepare_ding.py)")
        with open(path, encoding="utf-8") as f:
            sides.append([line.rstrip("\n") for line in f])
    if len(sides[0]) != len(sides[1]):
        sys.exit(f"error: {pairs_dir}/{name}.de and {name}.en have different numbers of lines")
    pairs = [p for p in zip(*sides) if short_enough(p[1], max_words)][:limit]
    if len(pairs) < limit:
        sys.exit(f"error: {pairs_dir}/{name}.en has {len(pairs)} usable pairs, {limit} requested")
    return pairs


def ding_pairs(args, sizes):
    """{MuST-C split: [(de, en)]}, from a prepare_ding output directory or the dictionary."""
    if args.pairs_dir:
        return {
            split: read_pairs_dir(args.pairs_dir, name, sizes[split], args.max_words)
            for split, name in SPLITS.items()
        }
    source = args.source or ding.DEFAULT_SOURCE
    if not os.path.exists(source):
        sys.exit(
            f"error: {source} not found; install Debian's dictionary with "
            "'apt-get install trans-de-en' or pass --source / --pairs-dir"
        )
    with open(source, encoding="utf-8") as f:
        pairs = [p for p in ding.extract_pairs(f) if short_enough(p[1], args.max_words)]
    try:
        by_name = ding.split_pairs(
            pairs, sizes["tst-COMMON"], sizes["dev"], args.seed, sizes["train"]
        )
    except ValueError as e:
        sys.exit(f"error: {source}: {e}")
    if len(by_name["train"]) < sizes["train"]:
        sys.exit(f"error: only {len(by_name['train'])} training pairs left in {source}")
    return {split: by_name[name] for split, name in SPLITS.items()}


def ding_utterances(args, sizes):
    with exit_on_os_error("--pairs-dir" if args.pairs_dir else "--source"):
        pairs = ding_pairs(args, sizes)
    return {split: [Utterance(en, de) for de, en in pairs[split]] for split in SPLITS}


def bible_utterances(args, sizes):
    """{MuST-C split: [Utterance]}: the held-out books for dev and tst-COMMON, canonical order."""
    try:
        pairs = bible.read_corpus(args.books.split(",") if args.books else None)
    except (bible.CorpusUnavailable, ValueError) as error:
        sys.exit(f"error: {error}")
    by_name = bible.split_by_book([p for p in pairs if short_enough(p[1], args.max_words)])
    held_out_books = {"train": None, "dev": bible.VALID_BOOKS, "tst-COMMON": bible.TEST_BOOKS}
    utterances = {}
    for split, name in SPLITS.items():
        available = [
            Utterance(en, es, f"{book} {chapter}:{verse}")
            for (book, chapter, verse), en, es in by_name[name]
        ]
        size = len(available) if sizes[split] is None else sizes[split]
        if not available or len(available) < size:
            shortage = describe_shortage(args, split, size, len(available), held_out_books[split])
            sys.exit(f"error: {shortage}")
        utterances[split] = available[:size]
    return utterances


def describe_shortage(args, split, requested, available, books):
    """Why a split cannot have `requested` verses: what it asked for and what there is."""
    verses = f"{split} verses" + (f" ({', '.join(books)})" if books else "")
    if args.max_words:
        verses += f" of at most {args.max_words} words"
    if args.books:
        verses += " in --books"
    if not available:
        advice = ": --books must include one of those books" if books and args.books else ""
        return f"no {verses}{advice}"
    return f"{SIZE_OPTIONS[split]} {requested:,}: only {available:,} {verses}"


@dataclass(frozen=True)
class Corpus:
    target: str  # the translation's language: the corpus is OUT/en-TARGET/data/...
    default_sizes: dict  # MuST-C split -> utterances; None: every pair the split has
    held_out_voice: str  # the default --held-out-voice
    utterances: Callable  # (args, sizes) -> {MuST-C split: [Utterance]}
    own_options: tuple  # options that only this corpus reads


CORPORA = {
    "ding-de-en": Corpus(
        target="de",
        default_sizes={"train": 2000, "dev": 200, "tst-COMMON": 200},
        held_out_voice="none",
        utterances=ding_utterances,
        own_options=("source", "pairs_dir"),
    ),
    "bible-en-es": Corpus(
        target="es",
        default_sizes={"train": None, "dev": None, "tst-COMMON": None},
        held_out_voice="en-us-nyc+f5",
        utterances=bible_utterances,
        own_options=("books",),
    ),
}


# ---------------------------------------------------------------- split folders


def split_dir(out_dir, corpus, split):
    return os.path.join(out_dir, f"en-{corpus.target}", "data", split)


def refuse_foreign_split_dirs(out_dir, corpus):
    """A non-empty split folder this script did not write is refused (even with --overwrite)."""
    for split in SPLITS:
        folder = split_dir(out_dir, corpus, split)
        try:
            check_output_dir(folder, TOOL)
        except FolderNotOwned:
            sys.exit(
                f"error: {folder} exists and was not written by {TOOL}.py; it is never replaced "
                "or written into: choose another --out-dir"
            )


def espeak_version():
    proc = subprocess.run(["espeak-ng", "--version"], capture_output=True, text=True)
    return proc.stdout.strip()


def split_settings(args, split, utterances, first_talk_id, voices):
    """Everything a split's files depend on: a folder recorded with other settings is spoken
    again from scratch, one with the same settings resumed. The texts enter as a digest: they
    already sit in the text files, and 10,000 verses would make the record large."""
    texts = json.dumps([list(u) for u in utterances], ensure_ascii=False)
    return {
        "corpus": args.corpus,
        "split": split,
        "utterances": len(utterances),
        "texts_sha256": hashlib.sha256(texts.encode("utf-8")).hexdigest(),
        "first_talk_id": first_talk_id,
        "utterances_per_talk": args.utterances_per_talk,
        "seed": args.seed,
        "accents": list(voices.accents),
        "variants": list(voices.variants),
        "words_per_minute": list(WORDS_PER_MINUTE),
        "pitch": list(PITCH),
        "pause_seconds": list(PAUSE_SECONDS),
        "sample_rate": SAMPLE_RATE,
        "espeak_ng": espeak_version(),
    }


def recorded_settings(folder):
    path = os.path.join(folder, SETTINGS_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def open_split_dir(folder, settings, talks):
    """Make `folder` ready for the split: resumed if recorded with `settings`, else emptied
    (only a folder of ours: refuse_foreign_split_dirs has refused any other)."""
    if recorded_settings(folder) == settings:
        remove_strays(folder, talks)
        return
    replace_own_dir(folder, TOOL)
    for part in ("wav", SEGMENTS_DIR, "txt"):
        os.makedirs(os.path.join(folder, part))
    atomic_write_text(os.path.join(folder, SETTINGS_FILE), json.dumps(settings, indent=1) + "\n")


def remove_strays(folder, talks):
    """A resumed folder ends as a new one would: in wav/ and segments/ only the split's talks
    stay (the temporary files of a killed run go, as anything else: the folder is ours)."""
    keep = {path for talk in talks for path in (talk.wav_path, talk.segments_path)}
    for part in ("wav", SEGMENTS_DIR):
        os.makedirs(os.path.join(folder, part), exist_ok=True)
        for entry in os.scandir(os.path.join(folder, part)):
            if entry.path in keep:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.remove(entry.path)
    remove_leftover_temporaries(os.path.join(folder, "txt"))


def split_talks(folder, split, utterances, first_talk_id, per_talk, seed, voices):
    talks = []
    for index, start in enumerate(range(0, len(utterances), per_talk)):
        name = f"ted_{first_talk_id + index}"
        talks.append(
            Talk(
                seed=seed,
                split=split,
                index=index,
                wav_path=os.path.join(folder, "wav", name + ".wav"),
                segments_path=os.path.join(folder, SEGMENTS_DIR, name + ".json"),
                sentences=tuple(u.english for u in utterances[start : start + per_talk]),
                voices=voices,
            )
        )
    return talks


def yaml_line(segment):
    """One MuST-C yaml entry; times are printed as MuST-C prints them (6 decimals)."""
    return (
        f"- {{duration: {segment['duration']:.6f}, offset: {segment['offset']:.6f}, "
        f"rW: {segment['rW']}, uW: {segment['uW']}, speaker_id: {segment['speaker_id']}, "
        f"wav: {segment['wav']}}}\n"
    )


def write_split_texts(folder, split, target, utterances, segments):
    columns = {
        "yaml": "".join(map(yaml_line, segments)),
        "en": "".join(u.english + "\n" for u in utterances),
        target: "".join(u.translation + "\n" for u in utterances),
    }
    if utterances[0].reference is not None:
        columns["ref"] = "".join(u.reference + "\n" for u in utterances)
    for suffix, text in columns.items():
        atomic_write_text(os.path.join(folder, "txt", f"{split}.{suffix}"), text)


def read_segments(talks):
    segments = []
    for talk in talks:
        with open(talk.segments_path, encoding="utf-8") as f:
            segments += json.load(f)
    return segments


def synthesize_split(args, corpus, split, utterances, first_talk_id, voices, pool):
    """Speak one split (what an earlier run left of it is kept); returns its number of talks."""
    folder = split_dir(args.out_dir, corpus, split)
    settings = split_settings(args, split, utterances, first_talk_id, voices)
    talks = split_talks(
        folder, split, utterances, first_talk_id, args.utterances_per_talk, args.seed, voices
    )
    open_split_dir(folder, settings, talks)
    speak_missing_talks(split, talks, pool)
    segments = read_segments(talks)
    write_split_texts(folder, split, corpus.target, utterances, segments)
    minutes = sum(s["duration"] for s in segments) / 60
    print(
        f"| {split}: {len(utterances):,} utterances in {len(talks):,} talks, "
        f"{minutes:.1f} min of speech",
        flush=True,
    )
    return len(talks)


# ---------------------------------------------------------------- the command line


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", required=True, help="corpus root (gets en-TGT/data/...)")
    parser.add_argument(
        "--corpus",
        choices=tuple(CORPORA),
        default="ding-de-en",
        help="ding-de-en: Ding's German-English sentences; bible-en-es: the English-Spanish "
        "Bible verses, the held-out books as dev (Ruth, Jonah, Philippians, Colossians) and "
        "tst-COMMON (Joshua, Romans)",
    )
    parser.add_argument(
        "--train-size",
        type=positive_int,
        help="training utterances, the first ones left after --max-words (default: 2000 for "
        "ding-de-en, every training verse for bible-en-es)",
    )
    parser.add_argument(
        "--dev-size",
        type=positive_int,
        help="dev utterances (default: 200 for ding-de-en, the whole dev books for bible-en-es)",
    )
    parser.add_argument(
        "--test-size",
        type=positive_int,
        help="tst-COMMON utterances (default: 200 for ding-de-en, the whole test books for "
        "bible-en-es)",
    )
    parser.add_argument(
        "--utterances-per-talk",
        type=positive_int,
        default=1,
        help="utterances per talk wav (MuST-C has many, each a segment with its offset)",
    )
    parser.add_argument(
        "--max-words",
        type=non_negative_int,
        default=0,
        help="keep only pairs whose English side has at most this many words (0: all)",
    )
    parser.add_argument(
        "--held-out-voice",
        type=held_out_voice,
        metavar="ACCENT+VARIANT",
        help="ACCENT+VARIANT speaking dev and tst-COMMON alone; training talks use neither its "
        "accent nor its variant; none: every split draws from every voice (default: none for "
        "ding-de-en, en-us-nyc+f5 for bible-en-es)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --out-dir this script did not create (it still deletes "
        "nothing there and refuses split folders it did not write)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--workers", type=positive_int, default=2, help="parallel synthesis processes"
    )
    parser.add_argument(
        "--source", help=f"ding-de-en: the Ding dictionary (default: {ding.DEFAULT_SOURCE})"
    )
    parser.add_argument(
        "--pairs-dir",
        help="ding-de-en: read {train,valid,test}.{de,en} written by scripts/prepare_ding.py "
        "instead",
    )
    parser.add_argument(
        "--books",
        help="bible-en-es: comma-separated books to read instead of the whole Bible (quick "
        "runs); the held-out books among them still go to dev and tst-COMMON",
    )
    return parser


def check_corpus_options(parser, args, corpus):
    """An option of the other corpus would be silently ignored: refuse it instead."""
    for name, other in CORPORA.items():
        for option in other.own_options:
            if other is not corpus and getattr(args, option) is not None:
                flag = "--" + option.replace("_", "-")
                parser.error(f"{flag} is an option of --corpus {name}, not of {args.corpus}")


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    corpus = CORPORA[args.corpus]
    check_corpus_options(parser, args, corpus)
    given = {"train": args.train_size, "dev": args.dev_size, "tst-COMMON": args.test_size}
    sizes = {split: given[split] or corpus.default_sizes[split] for split in SPLITS}
    voices = voices_by_split(args.held_out_voice or corpus.held_out_voice)
    if shutil.which("espeak-ng") is None:
        sys.exit("error: espeak-ng not found; install it with 'apt-get install espeak-ng'")

    with exit_on_os_error("--out-dir"):  # refused before the corpus is read
        check_output_dir(args.out_dir, TOOL, args.overwrite)
        refuse_foreign_split_dirs(args.out_dir, corpus)
    utterances = corpus.utterances(args, sizes)
    next_talk_id = 1
    with exit_on_os_error("--out-dir"), Pool(args.workers) as pool:
        claim_output_dir(args.out_dir, TOOL, args.overwrite)
        for split in SPLITS:
            next_talk_id += synthesize_split(
                args, corpus, split, utterances[split], next_talk_id, voices[split], pool
            )
    target_dir = os.path.join(args.out_dir, f"en-{corpus.target}")
    print(f"| synthetic MuST-C en-{corpus.target} -> {target_dir}")


if __name__ == "__main__":
    main()
