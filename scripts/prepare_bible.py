#!/usr/bin/env python3
"""Extract English-Spanish verse pairs from Debian's public-domain SWORD Bibles.

World English Bible (``sword-text-web``) and Reina-Valera 1909 (``sword-text-sparv``), read with
``diatheke``, markup removed, verses paired by reference; the books Ruth, Jonah, Philippians
and Colossians are the validation split, Joshua and Romans the test split, every other book is
training data. Writes ``{train,valid,test}.{en,es}`` and ``.ref`` (the verse of each line).
See ``local_attn_fairseq/experiments/bible.py``.
"""

import argparse
import sys

from local_attn_fairseq.experiments import bible
from local_attn_fairseq.file_safety import claim_output_dir


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", required=True, help="directory for {train,valid,test}.{en,es}")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into an --out-dir that holds other files (their split files are replaced)",
    )
    parser.add_argument("--max-train", type=int, help="keep the first N training pairs")
    parser.add_argument("--valid-size", type=int, help="keep the first N validation pairs")
    parser.add_argument("--test-size", type=int, help="keep the first N test pairs")
    parser.add_argument(
        "--books",
        help="comma-separated books to read instead of the whole Bible (quick runs); "
        "the held-out books among them still go to valid/test",
    )
    args = parser.parse_args(argv)
    for option in ("max_train", "valid_size", "test_size"):
        if getattr(args, option) is not None and getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1")
    books = args.books.split(",") if args.books else None
    try:
        claim_output_dir(args.out_dir, "scripts/prepare_bible.py", args.overwrite)
    except FileExistsError as error:
        sys.exit(f"error: --out-dir: {error}")
    try:
        splits = bible.split_by_book(bible.read_corpus(books), max_train=args.max_train)
    except (bible.CorpusUnavailable, ValueError) as error:
        sys.exit(f"error: {error}")
    for name, size in (("valid", args.valid_size), ("test", args.test_size)):
        splits[name] = splits[name][:size]
    empty = [name for name, pairs in splits.items() if not pairs]
    if empty:
        sys.exit(
            f"error: no verse pairs for {', '.join(empty)}: --books must include a held-out "
            f"book for each split (valid: {', '.join(bible.VALID_BOOKS)}; "
            f"test: {', '.join(bible.TEST_BOOKS)})"
        )
    bible.write_splits(splits, args.out_dir)
    print(f"| Bible en-es: {bible.describe(splits)} -> {args.out_dir}")


if __name__ == "__main__":
    main()
