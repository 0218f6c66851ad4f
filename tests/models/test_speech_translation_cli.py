"""ASR and ST with ``s2t_transformer_local`` through fairseq's CLI on the prepared synthetic corpus:
fbank manifests and raw-WAV manifests, WER and BLEU from fairseq-generate, the ST encoder
initialised from the ASR checkpoint."""

import re

import pytest
import torch

from local_attn_fairseq.experiments.speech_pipeline import SCORING

from ..conftest import USER_DIR, fairseq_cli
from ..scripts.speech_corpus import SIZES, prepared
from ..speech_data import asr_checkpoint, train_s2t
from .helpers import ensemble_token_scores

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


def test_print_alignment_is_refused_before_decoding(tmp_path_factory):
    """fairseq's aligning generator expands the source as token ids and crashes on filterbank
    frames (fairseq's own s2t_transformer too); the plugin refuses the option with the reason."""
    data, checkpoint = asr_checkpoint(tmp_path_factory)
    proc = fairseq_cli(
        "fairseq-generate", data, "--user-dir", USER_DIR, "--path", checkpoint, *GENERATE,
        "--config-yaml", "config_asr.yaml", "--gen-subset", "dev_asr", "--print-alignment",
        check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "--print-alignment aligns target tokens with source tokens" in proc.stderr
    assert "expand" not in proc.stderr  # not fairseq's crash


def test_encoder_freezing_updates_leave_the_encoder_as_initialised(tmp_path, tmp_path_factory):
    """fairseq's --encoder-freezing-updates N: the encoder keeps its initial weights for N
    updates while the decoder trains (an Adam step of lr 1e-30 stands for no step)."""
    data, _ = asr_checkpoint(tmp_path_factory)

    def trained(name, *extra):
        train_s2t(data, tmp_path / name, "asr", *extra)
        state = torch.load(tmp_path / name / "checkpoint_last.pt", map_location="cpu",
                           weights_only=False)["model"]  # fmt: skip
        return {k: v for k, v in state.items() if v.is_floating_point()}

    initial = trained("initial", "--lr", "1e-30")
    frozen = trained("frozen", "--encoder-freezing-updates", "2")
    free = trained("free")
    encoder = [k for k in initial if k.startswith("encoder.")]
    decoder = [k for k in initial if k.startswith("decoder.")]
    for name in encoder:
        torch.testing.assert_close(frozen[name], initial[name], atol=1e-12, rtol=0, msg=name)
    assert any(not torch.allclose(frozen[k], initial[k], atol=1e-6) for k in decoder)
    assert any(not torch.allclose(free[k], initial[k], atol=1e-6) for k in encoder)


def test_hub_interface_predicts_from_a_wav_with_the_training_features(tmp_path, tmp_path_factory):
    """fairseq's S2T hub interface on a model trained on utterance-CMVN filterbanks: from one
    segment cut out of its talk wav it computes the features the manifest holds for that
    segment, and its prediction is fairseq-generate's (beam 2)."""
    import soundfile as sf
    from fairseq.data.audio.audio_utils import get_features_or_waveform
    from fairseq.data.audio.feature_transforms.utterance_cmvn import UtteranceCMVN
    from fairseq.models.speech_to_text import S2TTransformerModel
    from fairseq.models.speech_to_text.hub_interface import S2THubInterface

    from ..scripts.speech_corpus import read_split, run_script, split_dir, synthetic_corpus

    corpus = synthetic_corpus(tmp_path_factory)
    data = tmp_path / "data"
    run_script("prepare_mustc.py", "--mustc-root", corpus, "--lang", "de", "--out-dir", data,
               "--vocab-size", 120, "--audio-format", "fbank", "--cmvn", "utterance")  # fmt: skip
    train(data, tmp_path / "asr", "asr", *LOCAL_WINDOWS)
    checkpoint = tmp_path / "asr" / "checkpoint_last.pt"

    segments, _ = read_split(corpus, "tst-COMMON")
    first = segments[0]
    audio, rate = sf.read(split_dir(corpus, "tst-COMMON") / "wav" / first["wav"], dtype="int16")
    start, n = round(float(first["offset"]) * rate), round(float(first["duration"]) * rate)
    wav = tmp_path / "segment.wav"
    sf.write(wav, audio[start : start + n], rate, subtype="PCM_16")
    manifest = (data / "tst-COMMON_asr.tsv").read_text("utf-8").splitlines()
    header = manifest[0].split("\t")
    rows = [dict(zip(header, line.split("\t"))) for line in manifest[1:]]
    talk = first["wav"].rsplit(".", 1)[0]
    [row] = [r for r in rows if r["id"] == f"{talk}_0"]  # the talk's first segment by offset

    hub = S2TTransformerModel.from_pretrained(
        str(checkpoint.parent), checkpoint_file=checkpoint.name, data_name_or_path=str(data),
        config_yaml="config_asr.yaml", beam=2, max_len_b=8,  # GENERATE's search
    )  # fmt: skip
    features = S2THubInterface.get_model_input(hub.task, str(wav))["net_input"]["src_tokens"][0]
    expected = UtteranceCMVN()(get_features_or_waveform(str(data / row["audio"])))
    torch.testing.assert_close(features, torch.from_numpy(expected), atol=1e-4, rtol=1e-4)
    samples = torch.from_numpy(audio[start : start + n] / 2**15).float()  # float samples too
    from_samples = S2THubInterface.get_model_input(hub.task, samples)["net_input"]
    torch.testing.assert_close(from_samples["src_tokens"][0], features, atol=1e-4, rtol=1e-4)
    assert from_samples["src_lengths"].tolist() == [features.size(0)]

    decoded = fairseq_cli(
        "fairseq-generate", data, "--user-dir", USER_DIR, "--path", checkpoint, *GENERATE,
        "--config-yaml", "config_asr.yaml", "--gen-subset", "tst-COMMON_asr",
    ).stdout  # fmt: skip
    index = rows.index(row)
    [line] = [x for x in decoded.splitlines() if x.startswith(f"D-{index}\t")]
    assert hub.predict(str(wav)) == line.split("\t")[2]


def positional_scores(proc):
    """The P- lines of fairseq-generate by utterance id (log-probabilities in base 2)."""
    scores = {}
    for line in proc.stdout.splitlines():
        kind, _, rest = line.partition("-")
        if kind == "P":
            utterance, values = rest.split("\t")
            scores[int(utterance)] = [float(x) for x in values.split()]
    return scores


def test_ensemble_of_a_local_and_a_global_model(tmp_path, tmp_path_factory):
    """``--path local.pt:global.pt``: beam search reorders both encoders' outputs and decodes
    every utterance; --score-reference gives each reference token the log of the two models'
    mean probability."""
    data = prepared(tmp_path_factory, "fbank")
    train(data, tmp_path / "local", "asr", *LOCAL_WINDOWS)
    train(data, tmp_path / "global", "asr", *GLOBAL_WINDOWS)
    models = [str(tmp_path / name / "checkpoint_last.pt") for name in ("local", "global")]
    ensemble = ":".join(models)
    generate(data, ensemble, "asr")

    def scored(path):
        proc = fairseq_cli(
            "fairseq-generate", data, "--user-dir", USER_DIR, "--path", path, *GENERATE,
            "--config-yaml", "config_asr.yaml", "--gen-subset", "tst-COMMON_asr",
            "--score-reference",
        )  # fmt: skip
        scores = positional_scores(proc)
        assert sorted(scores) == list(range(SIZES["tst-COMMON"])), proc.stdout[-2000:]
        return scores

    together, alone = scored(ensemble), [scored(path) for path in models]
    assert together != alone[0] and together != alone[1]
    for utterance, scores in together.items():
        expected = ensemble_token_scores([model[utterance] for model in alone])
        assert scores == pytest.approx(expected, abs=5e-4)  # printed to four decimals
