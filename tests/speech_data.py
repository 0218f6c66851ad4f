"""Tiny speech-to-text models and data for tests.

A fairseq speech_to_text data directory: random 20-dim "fbank" features saved as .npy files,
ASR and ST manifests (``{split}_asr.tsv``, ``{split}_st.tsv``), word-level targets and their
dictionaries (no sentencepiece: the configs have no ``bpe_tokenizer``); an ASR checkpoint
trained on it by fairseq-train, built once per test session; models built directly from an
architecture's defaults; padded feature batches.
"""

from argparse import Namespace

import numpy as np
import torch
from fairseq.data import Dictionary

from .conftest import USER_DIR, fairseq_cli

FEATURES = 20
WORDS = "one two three four five six seven eight nine ten".split()
TRANSLATIONS = "eins zwei drei vier fuenf sechs sieben acht neun zehn".split()
TINY_S2T = (
    "--encoder-embed-dim 32 --encoder-ffn-embed-dim 64 --decoder-embed-dim 32 "
    "--decoder-ffn-embed-dim 64 --conv-channels 32"
).split()
S2T_TRAIN = (
    "--task speech_to_text --optimizer adam --lr 1e-3 --max-tokens 4000 --batch-size 12 "
    "--num-workers 0 --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --seed 1 "
    "--max-update 2 --disable-validation --no-progress-bar --log-interval 1 "
    "--no-epoch-checkpoints --required-batch-size-multiple 1"
).split()

_BUILT = {}


def write_speech_data(root, sizes=(("train", 24), ("dev", 8))):
    """Manifests, configs, dictionary and features under ``root``; returns ``root``."""
    rng = np.random.default_rng(0)
    features = root / "fbank"
    features.mkdir(parents=True)
    header = "id\taudio\tn_frames\ttgt_text\tspeaker\n"
    for split, count in sizes:
        asr, st = [header], [header]
        for i in range(count):
            frames = int(rng.integers(30, 160))  # 8 to 40 encoder frames after the x4 subsampler
            path = features / f"{split}_{i}.npy"
            np.save(path, rng.standard_normal((frames, FEATURES)).astype(np.float32))
            chosen = rng.integers(0, len(WORDS), size=int(rng.integers(2, 6)))
            words = " ".join(WORDS[k] for k in chosen)
            translation = " ".join(TRANSLATIONS[k] for k in chosen)
            asr.append(f"{split}_{i}\t{path}\t{frames}\t{words}\tspk\n")
            st.append(f"{split}_{i}\t{path}\t{frames}\t{translation}\tspk\n")
        (root / f"{split}_asr.tsv").write_text("".join(asr), encoding="utf-8")
        (root / f"{split}_st.tsv").write_text("".join(st), encoding="utf-8")
    for task, vocab in (("asr", WORDS), ("st", TRANSLATIONS)):
        (root / f"dict_{task}.txt").write_text("".join(f"{w} 10\n" for w in vocab), "utf-8")
        (root / f"config_{task}.yaml").write_text(
            f"input_feat_per_channel: {FEATURES}\nvocab_filename: dict_{task}.txt\n", "utf-8"
        )
    return root


def train_s2t(data, save_dir, task, *extra, arch="s2t_transformer_local_tiny"):
    return fairseq_cli(
        "fairseq-train", data, "--user-dir", USER_DIR, "--arch", arch, *TINY_S2T, *S2T_TRAIN,
        "--config-yaml", f"config_{task}.yaml", "--train-subset", f"train_{task}",
        "--valid-subset", f"dev_{task}", "--save-dir", save_dir, *extra,
    )  # fmt: skip


def asr_checkpoint(tmp_path_factory):
    """(data directory, checkpoint of two fairseq-train updates of s2t_transformer_local_tiny
    on the ASR manifests), built once per session."""
    if not _BUILT:
        data = write_speech_data(tmp_path_factory.mktemp("speech_data"))
        save_dir = tmp_path_factory.mktemp("asr")
        train_s2t(data, save_dir, "asr")
        _BUILT.update(data=data, asr=save_dir / "checkpoint_last.pt")
    return _BUILT["data"], _BUILT["asr"]


def build_s2t(model_class, arch, **options):
    """A model built through the architecture's own defaults, without data or dropout."""
    args = Namespace(
        input_feat_per_channel=FEATURES,
        input_channels=1,
        max_source_positions=6000,
        max_target_positions=1024,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        **options,
    )
    arch(args)
    dictionary = Dictionary()
    for word in WORDS:
        dictionary.add_symbol(word)
    return model_class.build_model(args, Namespace(target_dictionary=dictionary))


def padded_fbank(lengths, seed=0):
    """A right-padded batch of random features (B, T, FEATURES) and its lengths."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(len(lengths), max(lengths), FEATURES, generator=generator)
    lengths = torch.tensor(lengths)
    features[torch.arange(max(lengths))[None, :] >= lengths[:, None]] = 0.0
    return features, lengths
