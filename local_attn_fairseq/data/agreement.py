"""Build a subject-verb agreement classification set from the English side of the Ding corpus.

Every sentence of ``scripts/prepare_ding.py``'s ``{train,valid,test}.en`` that holds an agreement
verb (is/are, was/were, has/have, does/do and their negated contractions) gives a minimal pair:
the sentence itself, labelled ``grammatical``, and a copy with the number of one such verb
flipped (chosen at random, seeded), labelled ``ungrammatical``. The two differ in one word, so
only the agreement of that verb with its subject tells them apart (Linzen et al. 2016's SVA task,
the third column of Nguyen et al.'s Table 5). A few flips stay acceptable (collective nouns, "if
I was"); the subjunctive "I/he/she/it were" is never flipped for that reason.

Text is lower-cased and punctuation split off. The splits follow the Ding splits, so no test
sentence is seen in training. Output, in the layout of fairseq's ``sentence_prediction`` task::

    OUT/raw/{train,valid,test}.{input0,label}     text, one example per line
    OUT/input0/{dict.txt,train.bin,...}           binarised by fairseq-preprocess --only-source
    OUT/label/{dict.txt,train.bin,...}

The three folders of a run are built beside the old ones (``raw.partial``, ...) and swapped in
only when all of them are whole (``file_safety.staged_dir``): a run with other settings replaces
the tool's own ``raw/``, ``input0/`` and ``label/`` whole, and an interrupted run leaves those of
the previous run as they were. Nothing else in OUT is touched.

It also prints the test accuracy of a baseline that sees only which agreement verb forms a
sentence contains (naive Bayes over the forms), i.e. what can be had without the subject.
"""

import argparse
import collections
import contextlib
import logging
import math
import os
import random
import re

from ..cli_types import positive_int
from ..file_safety import (
    FolderNotOwned,
    atomic_write_text,
    check_output_dir,
    claim_output_dir,
    exit_on_os_error,
    folder_owner,
    staged_dir,
)
from .text import refuse_incomplete_splits

SPLITS = ("train", "valid", "test")
OUTPUTS = ("raw", "input0", "label")  # the folders of a run in OUT, each replaced whole
TOOL = "scripts/prepare_classification.py"  # the owner named in the output folder
GRAMMATICAL, UNGRAMMATICAL = "grammatical", "ungrammatical"
_PAIRS = [
    ("is", "are"),
    ("was", "were"),
    ("has", "have"),
    ("does", "do"),
    ("isn't", "aren't"),
    ("wasn't", "weren't"),
    ("hasn't", "haven't"),
    ("doesn't", "don't"),
]
FLIP = {**dict(_PAIRS), **{plural: singular for singular, plural in _PAIRS}}
SUBJUNCTIVE_SUBJECTS = {"i", "he", "she", "it"}  # "if I were": were -> was would stay grammatical
_TOKEN = re.compile(r"\w+(?:'\w+)*|[^\w\s]")


def tokenize(sentence):
    return _TOKEN.findall(sentence.replace("\u2019", "'").lower())


def flippable_positions(tokens):
    """Positions of agreement verbs whose number can be flipped into an agreement error."""
    return [
        i
        for i, token in enumerate(tokens)
        if token in FLIP
        and not (token.startswith("were") and i > 0 and tokens[i - 1] in SUBJUNCTIVE_SUBJECTS)
    ]


def minimal_pair(tokens, rng):
    """(grammatical, ungrammatical) token lists, or None when nothing can be flipped."""
    positions = flippable_positions(tokens)
    if not positions:
        return None
    position = rng.choice(positions)
    flipped = list(tokens)
    flipped[position] = FLIP[tokens[position]]
    return tokens, flipped


def make_examples(sentences, seed):
    """[(tokens, label)]: both halves of each sentence's minimal pair."""
    rng = random.Random(seed)
    examples = []
    for sentence in sentences:
        pair = minimal_pair(tokenize(sentence), rng)
        if pair:
            examples += [(pair[0], GRAMMATICAL), (pair[1], UNGRAMMATICAL)]
    return examples


def write_raw(examples, raw_dir, split):
    texts = "".join(" ".join(tokens) + "\n" for tokens, _ in examples)
    labels = "".join(label + "\n" for _, label in examples)
    atomic_write_text(os.path.join(raw_dir, f"{split}.input0"), texts)
    atomic_write_text(os.path.join(raw_dir, f"{split}.label"), labels)


def binarize(raw_dir, dest_dir, field, workers):
    """fairseq-preprocess --only-source of one field into ``dest_dir`` (its dictionary from
    train)."""
    from fairseq import options
    from fairseq_cli import preprocess

    prefix = {split: os.path.join(raw_dir, f"{split}.{field}") for split in SPLITS}
    args = options.get_preprocessing_parser().parse_args(
        ["--only-source", "--trainpref", prefix["train"], "--validpref", prefix["valid"],
         "--testpref", prefix["test"], "--destdir", dest_dir, "--workers", str(workers)]
    )  # fmt: skip
    # fairseq adds a handler writing to <destdir>/preprocess.log and never removes it: left in
    # place, the next field's log (or a later run's, in one process) would go into this one's.
    logger = logging.getLogger("fairseq_cli.preprocess")
    before = list(logger.handlers)
    try:
        preprocess.main(args)
    finally:
        for handler in [h for h in logger.handlers if h not in before]:
            logger.removeHandler(handler)
            handler.close()


def check_outputs(out_dir, overwrite):
    """Raise FolderNotOwned, changing nothing, if OUT may not be written into or one of its
    `OUTPUTS` folders may not be replaced whole: in a folder of this tool they are its own
    (unmarked ones too, from before folders were marked); under --overwrite only absent, empty
    or marked ones are, since a user's own ``raw/`` would lose its other files."""
    check_output_dir(out_dir, TOOL, overwrite)
    ours = folder_owner(out_dir) == TOOL
    for name in OUTPUTS:
        folder = os.path.join(out_dir, name)
        if ours and folder_owner(folder) is None:
            continue
        try:
            check_output_dir(folder, TOOL)
        except FolderNotOwned:
            raise FolderNotOwned(
                f"{folder!r} was not written by {TOOL}, which replaces it whole: move it away "
                "or choose another --out-dir"
            ) from None


def write_outputs(examples, out_dir, workers):
    """OUT/raw, OUT/input0 and OUT/label of one run, built staged and swapped in together."""
    for name in OUTPUTS:
        folder = os.path.join(out_dir, name)
        if os.path.isdir(folder) and folder_owner(folder) is None:
            claim_output_dir(folder, TOOL, overwrite=True)  # an earlier run's (check_outputs)
    with contextlib.ExitStack() as stack:
        staging = {name: stack.enter_context(staged_dir(os.path.join(out_dir, name), TOOL))
                   for name in OUTPUTS}  # fmt: skip
        for split in SPLITS:
            write_raw(examples[split], staging["raw"], split)
        for field in ("input0", "label"):
            binarize(staging["raw"], staging[field], field, workers)


def verb_forms(tokens):
    return [t for t in tokens if t in FLIP]


def verb_form_baseline(train, test):
    """Test accuracy of naive Bayes over the agreement verb forms alone (add-one smoothing)."""
    counts = {label: collections.Counter() for label in (GRAMMATICAL, UNGRAMMATICAL)}
    for tokens, label in train:
        counts[label].update(verb_forms(tokens))
    totals = {label: sum(c.values()) + len(FLIP) for label, c in counts.items()}

    def score(tokens, label):
        return sum(math.log((counts[label][f] + 1) / totals[label]) for f in verb_forms(tokens))

    correct = sum(
        max(counts, key=lambda label: score(tokens, label)) == gold for tokens, gold in test
    )
    return correct / max(len(test), 1)


def read_sentences(ding_dir, split):
    refuse_incomplete_splits(ding_dir, "--ding-dir")
    with open(os.path.join(ding_dir, f"{split}.en"), encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--ding-dir", required=True, help="output of scripts/prepare_ding.py ({split}.en)"
    )
    parser.add_argument("--out-dir", required=True, help="data directory for sentence_prediction")
    parser.add_argument("--seed", type=int, default=1, help="which verb of a sentence is flipped")
    parser.add_argument(
        "--workers", type=positive_int, default=1, help="fairseq-preprocess workers"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into an --out-dir that holds other files (same-named files are replaced)",
    )
    args = parser.parse_args(argv)

    with exit_on_os_error("--out-dir"):  # refused before the corpus is read
        check_outputs(args.out_dir, args.overwrite)
    with exit_on_os_error("--ding-dir"):
        try:
            sentences = {split: read_sentences(args.ding_dir, split) for split in SPLITS}
        except ValueError as error:
            parser.error(str(error))
    empty = [split for split in SPLITS if not sentences[split]]
    if empty:
        parser.error(f"--ding-dir: {args.ding_dir} has no sentences for {', '.join(empty)}")
    examples = {
        split: make_examples(sentences[split], args.seed + offset)
        for offset, split in enumerate(SPLITS)
    }
    with exit_on_os_error("--out-dir"):
        claim_output_dir(args.out_dir, TOOL, args.overwrite)
        write_outputs(examples, args.out_dir, args.workers)
    sizes = ", ".join(f"{split} {len(examples[split])}" for split in SPLITS)
    baseline = verb_form_baseline(examples["train"], examples["test"])
    print(f"| subject-verb agreement from Ding: {sizes} examples -> {args.out_dir}")
    print(
        f"| verb-form baseline (naive Bayes over the verb forms only): test accuracy {baseline:.3f}"
    )


if __name__ == "__main__":
    main()
