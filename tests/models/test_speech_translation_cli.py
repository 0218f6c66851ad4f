"""ASR and ST with ``s2t_transformer_local`` through fairseq's CLI on the prepared synthetic corpus:
fbank manifests and raw-WAV manifests, WER and BLEU from fairseq-generate, the ST encoder
initialised from the ASR checkpoint."""

import re

import pytest
import torch

from local_attn_fairseq.experiments.speech_pipeline import SCORING

from ..conftest import USER_DIR, fairseq_cli
from ..scripts.speech_corpus import SIZES, prepared

# CPU-quick sizes of the plugin's tiny speech arch (6 encoder layers, the windows its default).
TINY = (
    "--encoder-embed-dim 32 --encoder-ffn-embed-dim 64 --decoder-embed-dim 32 "
    "--decoder-ffn-embed-dim 64 --conv-channels 32"
).split()
GLOBAL_WINDOWS = ["--encoder-attention-windows", "0,0,0,0,0,0"]
LOCAL_WINDOWS = ["--encoder-attention-windows", "0,0,3,5,5,7"]
TRAIN = (
    "--task speech_to_text --optimizer adam --lr 1e-3 --max-tokens 6000 --num-workers 0 "
    "--criterion label_smoothed_cross_entropy --label-smoothing 0.1 --seed 1 --max-update 2 "
    "--no-progress-bar --log-interval 1 --no-epoch-checkpoints --required-batch-size-multiple 1"
).split()
# fairseq-fixed drops a last batch smaller than --required-batch-size-multiple (default 8):
# with 1, every test utterance is decoded.
GENERATE = (
    "--task speech_to_text --beam 2 --max-len-b 8 --batch-size 4 --num-workers 0 "
    "--required-batch-size-multiple 1"
).split()


def train(data, save_dir, task, *extra):
    return fairseq_cli(
        "fairseq-train", data, "--user-dir", USER_DIR, "--arch", "s2t_transformer_local_tiny",
        *TINY, *TRAIN, "--config-yaml", f"config_{task}.yaml", "--train-subset", f"train_{task}",
        "--valid-subset", f"dev_{task}", "--save-dir", save_dir, *extra,
    )  # fmt: skip


def generate(data, checkpoint, task):
    proc = fairseq_cli(
        "fairseq-generate", data, "--user-dir", USER_DIR, "--path", checkpoint, *GENERATE,
        "--config-yaml", f"config_{task}.yaml", "--gen-subset", f"tst-COMMON_{task}",
        *SCORING[task],
    )  # fmt: skip
    hypotheses = [line for line in proc.stdout.splitlines() if line.startswith("D-")]
    assert len(hypotheses) == SIZES["tst-COMMON"], proc.stdout[-2000:]
    metric = r"WER: [\d.]+" if task == "asr" else r"BLEU = [\d.]+"
    match = re.search(metric, proc.stdout)
    assert match, proc.stdout[-2000:]
    print(f"{task}: {match.group(0)}")
    return proc


def encoder_weights(checkpoint):
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["model"]
    return {k: v for k, v in state.items() if k.startswith("encoder.")}


@pytest.mark.parametrize("audio_format", ["fbank", "wav"])
def test_asr_then_st_from_the_asr_encoder_train_and_generate(
    audio_format, tmp_path, tmp_path_factory
):
    data = prepared(tmp_path_factory, audio_format)
    asr_dir, st_dir = tmp_path / "asr", tmp_path / "st"
    train(data, asr_dir, "asr", *GLOBAL_WINDOWS)
    asr = asr_dir / "checkpoint_last.pt"
    generate(data, asr, "asr")

    log = train(data, st_dir, "st", *LOCAL_WINDOWS, "--load-pretrained-encoder-from", asr)
    assert f"loaded pretrained encoder from {asr}" in log.stdout + log.stderr
    assert "encoder attention windows: 0,0,3,5,5,7" in log.stdout + log.stderr
    st = st_dir / "checkpoint_last.pt"
    generate(data, st, "st")
    # Two Adam steps of 1e-3 move each weight by at most ~2e-3: the ST encoder started from
    # the ASR one, a fresh initialisation would be nowhere near it.
    asr_encoder, st_encoder = encoder_weights(asr), encoder_weights(st)
    assert asr_encoder.keys() == st_encoder.keys()
    for name, weight in asr_encoder.items():
        torch.testing.assert_close(st_encoder[name], weight, atol=5e-3, rtol=0, msg=name)


def test_decoder_layerdrop_from_the_command_line(tmp_path, tmp_path_factory):
    """fairseq's S2T model leaves --decoder-layerdrop unregistered although its decoder has
    LayerDrop; the plugin's speech model takes it, trains with it and stores it."""
    data = prepared(tmp_path_factory, "fbank")
    train(data, tmp_path, "asr", *LOCAL_WINDOWS, "--decoder-layerdrop", "0.5")
    checkpoint = tmp_path / "checkpoint_last.pt"
    stored = torch.load(checkpoint, map_location="cpu", weights_only=False)["cfg"]["model"]
    assert stored.decoder_layerdrop == 0.5
    generate(data, checkpoint, "asr")
