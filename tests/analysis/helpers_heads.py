"""Small models and batches for the head analyses (relevance, confidence, roles), built from a
hand-written dictionary so that no corpus is needed."""

import torch
from fairseq.data import LanguagePairDataset

from ..models.helpers import build_model

WORDS = (
    "das ist ein gutes buch haus der hund schläft this is a good book house dog sleeps .".split()
)
PAIRS = [
    ("das ist ein gutes buch .", "this is a good book ."),
    ("der hund schläft", "the dog sleeps"),
    ("ein haus", "a house"),
]
SMALL = (
    "--encoder-embed-dim 16 --encoder-ffn-embed-dim 32 --encoder-layers 2 "
    "--encoder-attention-heads 4 --decoder-embed-dim 16 --decoder-ffn-embed-dim 32 "
    "--decoder-layers 2 --decoder-attention-heads 4 --share-all-embeddings "
    "--source-lang de --target-lang en"
).split()


def write_dictionaries(directory, words=WORDS):
    """dict.de.txt and dict.en.txt (joined) with decreasing counts: the first word is the most
    frequent."""
    text = "".join(f"{word} {1000 - 10 * i}\n" for i, word in enumerate(words))
    for lang in ("de", "en"):
        (directory / f"dict.{lang}.txt").write_text(text, encoding="utf-8")
    return directory


def small_model(directory, arch="transformer_local", *extra, seed=0):
    """A 2+2-layer, 4-head model of ``arch`` with random weights, in eval mode."""
    torch.manual_seed(seed)
    model, task, _ = build_model(write_dictionaries(directory), arch, *SMALL, *extra)
    return model.eval(), task


def batch(task, pairs=PAIRS):
    """A fairseq batch of (source, target) sentences, padded as fairseq pads them."""
    dictionary = task.source_dictionary

    def encode(line):
        return dictionary.encode_line(line, add_if_not_exist=False).long()

    sources = [encode(s) for s, _ in pairs]
    targets = [encode(t) for _, t in pairs]
    dataset = LanguagePairDataset(
        sources, [len(s) for s in sources], dictionary,
        targets, [len(t) for t in targets], dictionary, shuffle=False,
    )  # fmt: skip
    return dataset.collater([dataset[i] for i in range(len(pairs))])
