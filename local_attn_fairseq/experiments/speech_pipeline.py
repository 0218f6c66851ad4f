"""The steps of Alastruey et al. (2022)'s recipe as fairseq runs them, shared by the speech
study and the speech demo: the model and its schedule, feature preparation, scoring with
``fairseq-generate`` and the contributions analysis that chooses the windows.
"""

import os
import random

from ..checkpoint_files import read_checkpoint, write_checkpoint
from ..data.mustc import read_manifest, write_manifest
from .demo import decode_and_score
from .fairseq_runner import USER_DIR, run_python, run_tool, up_to_date

ARCH = "s2t_transformer_local_tiny"
ENCODER_LAYERS = 6  # the tiny arch's
GLOBAL_WINDOWS = ",".join(["0"] * ENCODER_LAYERS)
# Batches of up to 10,000 filterbank frames (~17 verses of ~6 s); the seed is each run's own.
MAX_TOKENS = 10_000
SCHEDULE = (
    "--optimizer adam --adam-betas (0.9,0.98) --lr 2e-3 --lr-scheduler inverse_sqrt "
    "--warmup-updates 300 --clip-norm 10 --dropout 0.1 --label-smoothing 0.1 "
    "--required-batch-size-multiple 1 --num-workers 0 --no-epoch-checkpoints "
    f"--log-format simple --log-interval 50 --max-tokens {MAX_TOKENS}"
).split()
# ASR adds fairseq's CTC loss on the encoder output: with it a model this small learns to align
# audio and text within a CPU budget; without it the decoder learns the language of the
# transcripts and ignores the audio for many more epochs (docs/speech_translation.md measures
# it). ST keeps the plain loss.
CRITERION = {
    "asr": "--criterion label_smoothed_cross_entropy_with_ctc --ctc-weight 0.3".split(),
    "st": ["--criterion", "label_smoothed_cross_entropy"],
}
# fairseq-fixed drops a last batch smaller than --required-batch-size-multiple: with 1 every
# test utterance is decoded. A verse translates into up to ~60 pieces; 200 cuts none.
GENERATE = (
    "--task speech_to_text --beam 5 --batch-size 50 --num-workers 0 "
    "--required-batch-size-multiple 1 --max-len-a 0 --max-len-b 200"
).split()
SCORING = {
    "asr": "--scoring wer --wer-tokenizer 13a --wer-lowercase --wer-remove-punct".split(),
    "st": ["--scoring", "sacrebleu"],
}
METRIC = {"asr": "WER", "st": "BLEU"}
TEST_SUBSET = "tst-COMMON"


def prepare(corpus, data, vocab_size, workers, lang):
    """Filterbanks, manifests, vocabularies and configs of a MuST-C-layout corpus."""
    if os.path.exists(os.path.join(data, "config_st.yaml")):
        return
    run_python(
        [
            "-m", "local_attn_fairseq.data.mustc", "--mustc-root", corpus, "--lang", lang,
            "--out-dir", data, "--vocab-size", vocab_size, "--workers", workers,
        ]
    )  # fmt: skip


def score(data, checkpoint, task, out_path, subset=TEST_SUBSET):
    """WER (ASR) or BLEU (ST) of a checkpoint on one subset, decoded once per checkpoint (an
    interrupted decode is redone: ``demo.decode_and_score``)."""
    argv = [
        data, "--user-dir", USER_DIR, "--path", checkpoint, *GENERATE, "--config-yaml",
        f"config_{task}.yaml", "--gen-subset", f"{subset}_{task}", *SCORING[task],
    ]  # fmt: skip
    return decode_and_score(argv, checkpoint, out_path, METRIC[task])


def write_shuffled_audio_subset(data, task, subset=TEST_SUBSET, seed=1):
    """``<subset>_shuffled_<task>.tsv``: every utterance's text paired with another utterance's
    audio (a permutation with no fixed point). A model that translates from the audio scores
    far lower on it than on the real pairs; one that has only learnt the target language's
    common phrases scores the same on both. Returns the subset's name."""
    rows = read_manifest(os.path.join(data, f"{subset}_{task}.tsv"))
    if len(rows) < 2:
        raise ValueError(f"{subset}_{task} has {len(rows)} utterance(s): nothing to shuffle")
    # A random rotation of a shuffled order: each utterance gets a different one's audio.
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    audio = {order[i]: order[(i + 1) % len(order)] for i in range(len(order))}
    shuffled = [
        {**row, "audio": rows[audio[i]]["audio"], "n_frames": rows[audio[i]]["n_frames"]}
        for i, row in enumerate(rows)
    ]
    name = f"{subset}_shuffled"
    write_manifest(os.path.join(data, f"{name}_{task}.tsv"), shuffled)
    return name


def contributions(data, checkpoint, out_dir, num_sentences, task="asr"):
    """``local-attn-analyze contributions`` of an encoder over the dev set; returns the windows
    Algorithm 1 chooses from it (used from the ASR encoder; an ST model is analysed on the ST
    manifests for its CCD)."""
    windows_path = os.path.join(out_dir, "windows.txt")
    if not up_to_date(windows_path, checkpoint):
        argv = [
            "contributions", "--path", checkpoint, "--data", data, "--config-yaml",
            f"config_{task}.yaml", "--gen-subset", f"dev_{task}", "--num-sentences",
            num_sentences, "--output-dir", out_dir,
        ]  # fmt: skip
        run_tool("local-attn-analyze", argv, out_dir + ".log")
    with open(windows_path, encoding="utf-8") as f:
        return f.read().strip()


def write_initial_checkpoint(trained, path, pretrained_encoder=None):
    """The model a training run started from, in its checkpoint's format at ``path``: built from
    the run's own settings after seeding as fairseq-train does, with the encoder the run loaded
    (``--load-pretrained-encoder-from``, which its checkpoint no longer names) and the decoder
    its seed drew. Decoding it gives the untrained level."""
    import torch
    from fairseq import checkpoint_utils, tasks, utils

    if up_to_date(path, trained):
        return path
    state = read_checkpoint(trained)  # as saved; fairseq's reader turns its settings into a config
    cfg = checkpoint_utils.load_checkpoint_to_cpu(trained)["cfg"]
    cfg.model.load_pretrained_encoder_from = pretrained_encoder
    utils.import_user_module(cfg.common)
    utils.set_torch_seed(cfg.common.seed)
    model = tasks.setup_task(cfg.task).build_model(cfg.model)
    state = {**state, "model": model.state_dict(), "last_optimizer_state": None}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_checkpoint(lambda handle: torch.save(state, handle), path)
    return path
