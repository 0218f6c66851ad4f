"""Text corpora to fairseq's binary format: sentencepiece models, encoding, fairseq-preprocess.

Shared by the demos, the paper recipes and the small-scale study, so that every one of them
segments and binarises text the same way.
"""

import contextlib
import os
import re

from ..file_safety import OWNER_MARKER, atomic_output, atomic_write_text, publish, staged_dir

# Lies in a folder of split files while they are replaced one by one (a folder that holds other
# files too, so it cannot be swapped whole): the set is then partly of two runs until a run ends.
SPLITS_INCOMPLETE = ".local_attn_fairseq_incomplete"


class VocabularyTooLarge(ValueError):
    """sentencepiece cannot make ``requested`` pieces from the data: it allows ``largest``."""

    def __init__(self, requested, largest):
        super().__init__(
            f"vocabulary size {requested} is too large for the data: at most {largest}"
        )
        self.requested, self.largest = requested, largest


# sentencepiece's own ids; the speech preparation passes fairseq's (its dictionary's order).
SENTENCEPIECE_SPECIAL_IDS = {"bos_id": -1, "eos_id": -1, "pad_id": -1, "unk_id": 0}


def train_sentencepiece(
    inputs,
    prefix,
    vocab_size,
    model_type="unigram",
    max_sentences=None,
    exact_size=True,
    special_ids=None,
):
    """Train a sentencepiece model on the files ``inputs``; writes ``prefix.model`` and
    ``prefix.vocab`` and returns the model's path.

    sentencepiece writes both files itself, so it writes them under a hidden prefix beside
    ``prefix`` (``.NAME.partial``, reused by the next try after a kill), and each is renamed into
    place once complete, the vocabulary last: a ``prefix.vocab`` means the model beside it is
    whole. A failed or interrupted training leaves the previous model, if any, as it was.

    ``max_sentences`` samples that many lines (sentencepiece's own sampling) for corpora too big
    to hold in memory. With ``exact_size=False`` the vocabulary size is a ceiling, so a corpus too
    small for it (a test slice) gets what it supports instead of an error.
    """
    import sentencepiece as spm

    prefix = str(prefix)
    folder, name = os.path.split(prefix)
    partial = os.path.join(folder, f".{name}.partial")
    options = dict(
        input=",".join(str(p) for p in inputs),
        model_prefix=partial,
        vocab_size=vocab_size,
        character_coverage=1.0,
        model_type=model_type,
        hard_vocab_limit=exact_size,
        minloglevel=2,
        **(SENTENCEPIECE_SPECIAL_IDS if special_ids is None else special_ids),
    )
    if max_sentences:
        options.update(input_sentence_size=max_sentences, shuffle_input_sentence=True)
    try:
        try:
            spm.SentencePieceTrainer.train(**options)
        except RuntimeError as error:
            # sentencepiece's "Vocabulary size too high (4000). Please set it to a value <= 606.":
            # a corpus too small for the size asked, which the caller reports against its option.
            largest = re.search(r"Vocabulary size too high .*<= (\d+)", str(error))
            if largest is None:
                raise
            raise VocabularyTooLarge(vocab_size, int(largest.group(1))) from None
        for ext in (".model", ".vocab"):
            publish(partial + ext, prefix + ext)
    finally:
        for ext in (".model", ".vocab"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(partial + ext)
    return f"{prefix}.model"


def encode_file(model_path, src_path, out_path):
    """Write ``src_path`` as space-separated sentencepiece pieces, one line per line; the file
    appears under ``out_path`` whole or not at all."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    with atomic_output(out_path) as temporary:
        with open(src_path, encoding="utf-8") as src, open(temporary, "w", encoding="utf-8") as out:
            for line in src:
                out.write(" ".join(sp.encode(line.strip(), out_type=str)) + "\n")


def preprocess_argv(source, target, prefixes, dest_dir, joined, workers=2):
    """fairseq-preprocess options for {split: file prefix}.

    Without a target the corpus is monolingual and its prefixes name whole files: fairseq's
    language_modeling task reads ``train.bin`` and ``dict.txt``, without language suffixes.
    """
    argv = ["--destdir", dest_dir, "--workers", str(workers)]
    argv += ["--source-lang", source, "--target-lang", target] if target else ["--only-source"]
    for split in ("train", "valid", "test"):
        if split in prefixes:
            argv += [f"--{split}pref", str(prefixes[split])]
    if joined and target:
        argv.append("--joined-dictionary")
    return argv


def has_binarised(dest_dir, split, source, target=None):
    name = f"{split}.{source}-{target}.{target}.bin" if target else f"{split}.bin"
    return os.path.exists(os.path.join(dest_dir, name))


def lines_text(lines):
    """One line per item, each ended by a newline, as the split files are written."""
    return "".join(line + "\n" for line in lines)


def write_split_set(files, out_dir, tool):
    """Write ``{file name: text}`` into ``out_dir`` (already claimed by ``tool``) as one set, so
    that no reader takes files of two runs for one corpus.

    A folder holding nothing but these files and its owner's marker is built beside itself and
    swapped in whole (``file_safety.staged_dir``): a killed run leaves the previous set. A folder
    holding other files too (written into with --overwrite) keeps them: its set is replaced file
    by file, each whole, under a `SPLITS_INCOMPLETE` record written first and removed last,
    which `splits_complete` and the readers of such folders refuse.
    """
    out_dir = os.path.abspath(out_dir)  # "out/" would stage in "out/.partial", inside itself
    entries = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    own_names = set(files) | {OWNER_MARKER, SPLITS_INCOMPLETE}
    cwd = os.getcwd()
    # A link, a mount point or the current folder is not to be renamed away: written in place.
    fixed = os.path.islink(out_dir) or os.path.ismount(out_dir)
    fixed = fixed or cwd == out_dir or cwd.startswith(out_dir + os.sep)
    swappable = not fixed and all(
        name in own_names and os.path.isfile(os.path.join(out_dir, name)) for name in entries
    )
    if swappable:
        with staged_dir(out_dir, tool) as staging:
            for name, text in files.items():
                atomic_write_text(os.path.join(staging, name), text)
        return
    record = os.path.join(out_dir, SPLITS_INCOMPLETE)
    atomic_write_text(record, tool + "\n")
    for name, text in files.items():
        atomic_write_text(os.path.join(out_dir, name), text)
    os.remove(record)


def splits_complete(folder, names):
    """Whether ``folder`` holds all of ``names`` from one run of a split-writing tool."""
    present = all(os.path.isfile(os.path.join(folder, name)) for name in names)
    return present and not os.path.exists(os.path.join(folder, SPLITS_INCOMPLETE))


def refuse_incomplete_splits(folder, option):
    """Raise ValueError naming ``option`` for a folder whose split set a killed run left partly
    replaced (see `write_split_set`)."""
    if os.path.exists(os.path.join(folder, SPLITS_INCOMPLETE)):
        raise ValueError(
            f"{option}: {folder} holds split files of two runs (a run that replaced them was "
            "interrupted); run the tool that wrote them again"
        )
