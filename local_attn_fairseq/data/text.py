"""Text corpora to fairseq's binary format: sentencepiece models, encoding, fairseq-preprocess.

Shared by the demos, the paper recipes and the small-scale study, so that every one of them
segments and binarises text the same way.
"""

import os
import re


class VocabularyTooLarge(ValueError):
    """sentencepiece cannot make ``requested`` pieces from the data: it allows ``largest``."""

    def __init__(self, requested, largest):
        super().__init__(
            f"vocabulary size {requested} is too large for the data: at most {largest}"
        )
        self.requested, self.largest = requested, largest


def train_sentencepiece(
    inputs, prefix, vocab_size, model_type="unigram", max_sentences=None, exact_size=True
):
    """Train a sentencepiece model on the files ``inputs``; writes ``prefix.model``.

    ``max_sentences`` samples that many lines (sentencepiece's own sampling) for corpora too big
    to hold in memory. With ``exact_size=False`` the vocabulary size is a ceiling, so a corpus too
    small for it (a test slice) gets what it supports instead of an error.
    """
    import sentencepiece as spm

    options = dict(
        input=",".join(str(p) for p in inputs),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        character_coverage=1.0,
        model_type=model_type,
        bos_id=-1,
        eos_id=-1,
        pad_id=-1,
        unk_id=0,
        hard_vocab_limit=exact_size,
        minloglevel=2,
    )
    if max_sentences:
        options.update(input_sentence_size=max_sentences, shuffle_input_sentence=True)
    try:
        spm.SentencePieceTrainer.train(**options)
    except RuntimeError as error:
        # sentencepiece's "Vocabulary size too high (4000). Please set it to a value <= 606.":
        # a corpus too small for the size asked, which the caller reports against its option.
        largest = re.search(r"Vocabulary size too high .*<= (\d+)", str(error))
        if largest is None:
            raise
        raise VocabularyTooLarge(vocab_size, int(largest.group(1))) from None
    return f"{prefix}.model"


def encode_file(model_path, src_path, out_path):
    """Write ``src_path`` as space-separated sentencepiece pieces, one line per line."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    with open(src_path, encoding="utf-8") as src, open(out_path, "w", encoding="utf-8") as out:
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
