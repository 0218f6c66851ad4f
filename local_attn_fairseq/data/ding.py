"""Extract German-English sentence pairs from the Ding dictionary (Debian's ``trans-de-en``).

Each dictionary line reads ``DE :: EN``; both sides split on `` | `` into aligned sub-entries,
many of which are example sentences. For every aligned sub-entry we keep the first ``; ``
alternative, drop the ``{..}``, ``[..]`` and ``<..>`` annotations, and keep the pair when both
sides are full sentences (capitalised, closing punctuation, at least ``--min-words`` words).
Duplicates are removed and a seeded split writes ``{train,valid,test}.{de,en}`` into an output
folder the tool claims (``file_safety.claim_output_dir``): a new or empty one, or one it wrote
before; another non-empty folder only with ``--overwrite``. The six files are replaced as one
set (``text.write_split_set``), so an interrupted run never leaves splits of two seeds.

The dictionary is GPL-licensed: it is read from the system at run time and never shipped.
"""

import argparse
import os
import random
import re
import sys

from ..cli_types import positive_int
from ..file_safety import check_output_dir, claim_output_dir, exit_on_os_error
from .text import lines_text, write_split_set

DEFAULT_SOURCE = "/usr/share/trans/de-en"
# The owner named in the folders it writes (claim_output_dir): a folder of an earlier run is reused.
TOOL = "scripts/prepare_ding.py"
_ANNOTATION = re.compile(r"\{[^}]*\}|\[[^\]]*\]|<[^>]*>")
_SPACES = re.compile(r"\s+")
_SENTENCE_END = (".", "!", "?")


def clean_side(text):
    """First ``; `` alternative of one sub-entry, without annotations, whitespace normalised."""
    first = text.split("; ")[0]
    return _SPACES.sub(" ", _ANNOTATION.sub(" ", first)).strip()


def is_sentence(text, min_words):
    return (
        len(text.split()) >= min_words
        and text[0].isupper()
        and text.endswith(_SENTENCE_END)
        and not any(c in text for c in "{}[]<>|")
    )


def sentence_of(raw, min_words):
    """The cleaned sub-entry if it is a sentence, else None. Most sub-entries are single words
    without a full stop: they are dropped before the (costlier) cleaning."""
    if not any(mark in raw for mark in _SENTENCE_END):
        return None
    text = clean_side(raw)
    return text if is_sentence(text, min_words) else None


def extract_pairs(lines, min_words=4):
    """Yield (de, en) sentence pairs from dictionary lines, in file order, deduplicated."""
    seen = set()
    for line in lines:
        line = line.rstrip("\n")
        if not line or line.startswith("#") or " :: " not in line:
            continue
        de_side, en_side = line.split(" :: ", 1)
        de_parts, en_parts = de_side.split(" | "), en_side.split(" | ")
        if len(de_parts) != len(en_parts):
            continue  # misaligned entry: pairing its parts would be guesswork
        for de_raw, en_raw in zip(de_parts, en_parts):
            de = sentence_of(de_raw, min_words)
            en = sentence_of(en_raw, min_words) if de is not None else None
            if en is None:
                continue
            if (de, en) in seen:
                continue
            seen.add((de, en))
            yield de, en


def split_pairs(pairs, n_test, n_valid, seed, max_train=None):
    """{"test", "valid", "train": [pair]}: disjoint, seeded; every split holds at least one pair."""
    sizes = {"n_test": n_test, "n_valid": n_valid, "max_train": max_train}
    small = [f"{name}={size}" for name, size in sizes.items() if size is not None and size < 1]
    if small:
        raise ValueError(f"split sizes must be at least 1: {', '.join(small)}")
    if len(pairs) <= n_test + n_valid:
        raise ValueError(
            f"only {len(pairs)} sentence pairs, not enough for {n_test} test + {n_valid} valid "
            "and a training split"
        )
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    shuffled = [pairs[i] for i in order]
    return {
        "test": shuffled[:n_test],
        "valid": shuffled[n_test : n_test + n_valid],
        "train": shuffled[n_test + n_valid :][:max_train],
    }


def write_splits(splits, out_dir, src="de", tgt="en"):
    """``{split}.{src}`` and ``{split}.{tgt}`` into ``out_dir`` (claimed by `TOOL`), the set of
    files replaced as one (``text.write_split_set``)."""
    files = {
        f"{name}.{lang}": lines_text(pair[side] for pair in pairs)
        for name, pairs in splits.items()
        for side, lang in enumerate((src, tgt))
    }
    write_split_set(files, out_dir, TOOL)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default=DEFAULT_SOURCE, help="Ding dictionary file")
    parser.add_argument("--out-dir", required=True, help="directory for {train,valid,test}.{de,en}")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into an --out-dir that holds other files (their split files are replaced)",
    )
    parser.add_argument("--test-size", type=positive_int, default=1000)
    parser.add_argument("--valid-size", type=positive_int, default=500)
    parser.add_argument("--min-words", type=positive_int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--max-train",
        type=positive_int,
        default=None,
        help="keep only this many training pairs (smoke runs)",
    )
    args = parser.parse_args(argv)

    if not os.path.exists(args.source):
        sys.exit(
            f"error: {args.source} not found; install Debian's dictionary with "
            "'apt-get install trans-de-en' or pass --source"
        )
    with exit_on_os_error("--out-dir"):  # refused before the dictionary is read
        check_output_dir(args.out_dir, TOOL, args.overwrite)
    with exit_on_os_error("--source"), open(args.source, encoding="utf-8") as f:
        pairs = list(extract_pairs(f, args.min_words))
    if len(pairs) <= args.test_size + args.valid_size:
        parser.error(
            f"--test-size {args.test_size} + --valid-size {args.valid_size} leave no training "
            f"pairs: {args.source} gives {len(pairs)} sentence pairs of --min-words "
            f"{args.min_words}"
        )
    splits = split_pairs(pairs, args.test_size, args.valid_size, args.seed, args.max_train)
    with exit_on_os_error("--out-dir"):
        claim_output_dir(args.out_dir, TOOL, args.overwrite)
        write_splits(splits, args.out_dir)
    sizes = ", ".join(f"{k} {len(v)}" for k, v in splits.items())
    print(f"| Ding de-en: {len(pairs)} sentence pairs ({sizes}) -> {args.out_dir}")


if __name__ == "__main__":
    main()
