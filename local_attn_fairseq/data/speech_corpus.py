"""Speak the English side of the Ding de-en sentence pairs: a synthetic corpus in MuST-C's layout.

Sentence pairs come from Debian's Ding dictionary (``ding.py``); Debian's
``espeak-ng`` reads the English sentences aloud. Each talk gets one speaker (an English accent
and a voice variant) and each utterance its own speed and pitch, all drawn from a seeded RNG, so
the corpus is the same for a given seed whatever the number of workers. Audio is resampled to
16 kHz mono 16-bit WAV. The output is laid out as MuST-C is::

    OUT/en-de/data/{train,dev,tst-COMMON}/wav/ted_<N>.wav
    OUT/en-de/data/<split>/txt/<split>.{yaml,en,de}

``<split>.yaml`` has one line per segment,
``- {duration: D, offset: O, rW: words, uW: 0, speaker_id: spk.ACCENT.VARIANT, wav: ted_N.wav}``,
aligned with the lines of ``<split>.en`` and ``<split>.de``. With ``--utterances-per-talk K`` a
talk wav holds K utterances separated by pauses, and the segments carry their offsets, as real
MuST-C talks do.

The script never removes what it did not write: ``--out-dir`` must be empty, new, or an earlier
output of this script (whose split folders it then replaces); ``--overwrite`` lets it write into
another folder, e.g. a MuST-C root holding other language pairs, but a split folder it did not
create is still refused, never replaced.
"""

import argparse
import io
import os
import random
import shutil
import subprocess
import sys
from multiprocessing import Pool

import numpy as np
import soundfile as sf

from . import ding
from ..cli_types import non_negative_int, positive_int
from ..file_safety import (
    atomic_write_text,
    claim_output_dir,
    exit_on_os_error,
    replace_own_dir,
)

TOOL = "synthesize_speech_corpus"

SAMPLE_RATE = 16_000
# MuST-C split name -> the Ding split its sentences come from.
SPLITS = {"train": "train", "dev": "valid", "tst-COMMON": "test"}
# espeak-ng's own English voices (the MBROLA ones need voice data Debian does not ship with it).
ACCENTS = [
    "en-us", "en-gb", "en-gb-scotland", "en-gb-x-gbclan", "en-gb-x-rp", "en-gb-x-gbcwmd",
    "en-029", "en-us-nyc",
]  # fmt: skip
VARIANTS = ["m1", "m2", "m3", "m4", "m5", "m6", "m7", "f1", "f2", "f3", "f4", "f5"]
WORDS_PER_MINUTE = (135, 185)
PITCH = (25, 75)
PAUSE_SECONDS = (0.3, 0.9)  # between the utterances of one talk


def talk_rng(seed, split, talk_index):
    # A string seed is hashed deterministically, so each talk's draws are independent of the
    # order in which workers pick talks up.
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


def synthesize_talk(job):
    """Write one talk wav; returns its segments' yaml fields, in order."""
    import torch

    torch.set_num_threads(1)  # the workers already share the cores
    seed, split, talk_index, wav_path, sentences = job
    rng = talk_rng(seed, split, talk_index)
    accent, variant = rng.choice(ACCENTS), rng.choice(VARIANTS)
    pieces, segments, position = [], [], 0
    for i, sentence in enumerate(sentences):
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
                "wav": os.path.basename(wav_path),
            }
        )
        position += len(audio)
    waveform = np.clip(np.concatenate(pieces), -1.0, 1.0)
    sf.write(wav_path, waveform, SAMPLE_RATE, subtype="PCM_16")
    return segments


def yaml_line(segment):
    """One MuST-C yaml entry; times are printed as MuST-C prints them (6 decimals)."""
    return (
        f"- {{duration: {segment['duration']:.6f}, offset: {segment['offset']:.6f}, "
        f"rW: {segment['rW']}, uW: {segment['uW']}, speaker_id: {segment['speaker_id']}, "
        f"wav: {segment['wav']}}}\n"
    )


def write_split(split_dir, split, pairs, segments):
    txt = os.path.join(split_dir, "txt")
    atomic_write_text(os.path.join(txt, f"{split}.yaml"), "".join(map(yaml_line, segments)))
    for lang, side in (("de", 0), ("en", 1)):
        lines = "".join(pair[side] + "\n" for pair in pairs)
        atomic_write_text(os.path.join(txt, f"{split}.{lang}"), lines)


def claim_split_dir(split_dir):
    """Refuse a non-empty split folder that this script did not write (even with --overwrite)."""
    try:
        claim_output_dir(split_dir, TOOL)
    except FileExistsError:
        sys.exit(
            f"error: {split_dir} exists and was not written by {TOOL}.py; it is never replaced "
            "or written into: choose another --out-dir"
        )


def synthesize_split(out_root, split, pairs, first_talk_id, utterances_per_talk, seed, pool):
    split_dir = os.path.join(out_root, "en-de", "data", split)
    replace_own_dir(split_dir, TOOL)  # claim_split_dir has refused any folder not ours
    os.makedirs(os.path.join(split_dir, "wav"))
    os.makedirs(os.path.join(split_dir, "txt"))
    jobs = []
    for talk_index, start in enumerate(range(0, len(pairs), utterances_per_talk)):
        wav_path = os.path.join(split_dir, "wav", f"ted_{first_talk_id + talk_index}.wav")
        english = [en for _, en in pairs[start : start + utterances_per_talk]]
        jobs.append((seed, split, talk_index, wav_path, english))
    segments = [s for talk in pool.imap(synthesize_talk, jobs, chunksize=4) for s in talk]
    write_split(split_dir, split, pairs, segments)
    seconds = sum(s["duration"] for s in segments)
    print(
        f"| {split}: {len(pairs)} utterances in {len(jobs)} talks, {seconds / 60:.1f} min of speech"
    )
    return len(jobs)


def short_enough(pair, max_words):
    return not max_words or len(pair[1].split()) <= max_words


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
    pairs = [p for p in zip(*sides) if short_enough(p, max_words)][:limit]
    if len(pairs) < limit:
        sys.exit(f"error: {pairs_dir}/{name}.en has {len(pairs)} usable pairs, {limit} requested")
    return pairs


def load_pairs(args, sizes):
    """{MuST-C split: [(de, en)]}, from a prepare_ding output directory or the dictionary."""
    if args.pairs_dir:
        return {
            split: read_pairs_dir(args.pairs_dir, name, sizes[split], args.max_words)
            for split, name in SPLITS.items()
        }
    if not os.path.exists(args.source):
        sys.exit(
            f"error: {args.source} not found; install Debian's dictionary with "
            "'apt-get install trans-de-en' or pass --source / --pairs-dir"
        )
    with open(args.source, encoding="utf-8") as f:
        pairs = [p for p in ding.extract_pairs(f) if short_enough(p, args.max_words)]
    try:
        by_name = ding.split_pairs(
            pairs, sizes["tst-COMMON"], sizes["dev"], args.seed, sizes["train"]
        )
    except ValueError as e:
        sys.exit(f"error: {args.source}: {e}")
    if len(by_name["train"]) < sizes["train"]:
        sys.exit(f"error: only {len(by_name['train'])} training pairs left in {args.source}")
    return {split: by_name[name] for split, name in SPLITS.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", required=True, help="corpus root (gets en-de/data/...)")
    parser.add_argument("--train-size", type=positive_int, default=2000)
    parser.add_argument("--dev-size", type=positive_int, default=200)
    parser.add_argument("--test-size", type=positive_int, default=200, help="tst-COMMON utterances")
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
        "--overwrite",
        action="store_true",
        help="write into a non-empty --out-dir this script did not create (it still deletes "
        "nothing there and refuses split folders it did not write)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--workers", type=positive_int, default=2, help="parallel synthesis processes"
    )
    parser.add_argument("--source", default=ding.DEFAULT_SOURCE, help="Ding dictionary")
    parser.add_argument(
        "--pairs-dir",
        help="read {train,valid,test}.{de,en} written by scripts/prepare_ding.py instead",
    )
    args = parser.parse_args(argv)

    sizes = {"train": args.train_size, "dev": args.dev_size, "tst-COMMON": args.test_size}
    if shutil.which("espeak-ng") is None:
        sys.exit("error: espeak-ng not found; install it with 'apt-get install espeak-ng'")

    with exit_on_os_error("--pairs-dir" if args.pairs_dir else "--source"):
        pairs = load_pairs(args, sizes)
    with exit_on_os_error("--out-dir"):
        claim_output_dir(args.out_dir, TOOL, args.overwrite)
        for split in SPLITS:  # refuse a foreign split folder before any synthesis starts
            split_dir = os.path.join(args.out_dir, "en-de", "data", split)
            if os.path.exists(split_dir):
                claim_split_dir(split_dir)
    next_talk_id = 1
    with exit_on_os_error("--out-dir"), Pool(args.workers) as pool:
        for split in SPLITS:
            next_talk_id += synthesize_split(
                args.out_dir, split, pairs[split], next_talk_id, args.utterances_per_talk,
                args.seed, pool,
            )  # fmt: skip
    print(f"| synthetic MuST-C en-de -> {os.path.join(args.out_dir, 'en-de')}")


if __name__ == "__main__":
    main()
