"""The synthetic MuST-C corpus and its preparation for fairseq's speech_to_text task."""

import csv
import os
import shutil

import numpy as np
import pytest
import soundfile as sf
import yaml

from local_attn_fairseq.data import mustc as prepare_mustc
from local_attn_fairseq.data import speech_corpus as synthesize_speech_corpus

from .speech_corpus import (
    SIZES,
    UTTERANCES_PER_TALK,
    log,
    prepared,
    read_split,
    split_dir,
    synthetic_corpus,
)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    return synthetic_corpus(tmp_path_factory)


@pytest.fixture(scope="session")
def fbank_data(tmp_path_factory):
    return prepared(tmp_path_factory, "fbank")


@pytest.fixture(scope="session")
def wav_data(tmp_path_factory):
    return prepared(tmp_path_factory, "wav")


def read_manifest(path):
    with open(path, encoding="utf-8") as f:
        return list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))


def fairseq_source(audio, need_waveform=False):
    from fairseq.data.audio.audio_utils import get_features_or_waveform

    return get_features_or_waveform(audio, need_waveform=need_waveform)


# ---------------------------------------------------------------- synthesis


def test_synthesis_writes_mustc_layout_with_offsets(corpus):
    assert "| train: 24 utterances in 8 talks" in log("synthesis_log")
    speakers = {
        f"spk.{a}.{v}"
        for a in synthesize_speech_corpus.ACCENTS
        for v in synthesize_speech_corpus.VARIANTS
    }
    for split, size in SIZES.items():
        segments, lines = read_split(corpus, split)
        assert len(segments) == len(lines["en"]) == len(lines["de"]) == size
        assert len(os.listdir(split_dir(corpus, split) / "wav")) == size // UTTERANCES_PER_TALK
        # Ding's files are MuST-C's en-de files, no more (the Bible's corpus adds <split>.ref)
        assert sorted(os.listdir(split_dir(corpus, split) / "txt")) == [
            f"{split}.{ext}" for ext in ("de", "en", "yaml")
        ]
        for seg, en in zip(segments, lines["en"]):
            assert set(seg) == {"duration", "offset", "rW", "uW", "speaker_id", "wav"}
            assert int(seg["rW"]) == len(en.split()) and seg["speaker_id"] in speakers
        for talk in range(0, size, UTTERANCES_PER_TALK):
            check_talk(
                split_dir(corpus, split) / "wav", segments[talk : talk + UTTERANCES_PER_TALK]
            )


def check_talk(wav_dir, segments):
    """One speaker per talk; segments in order, separated by silent pauses, ending the file."""
    assert len({s["wav"] for s in segments}) == 1 and len({s["speaker_id"] for s in segments}) == 1
    info = sf.info(str(wav_dir / segments[0]["wav"]))
    assert (info.samplerate, info.channels, info.subtype) == (16000, 1, "PCM_16")
    audio, _ = sf.read(str(wav_dir / segments[0]["wav"]), dtype="int16")
    spans = [
        (round(float(s["offset"]) * 16000), round(float(s["duration"]) * 16000)) for s in segments
    ]
    assert spans[0][0] == 0 and sum(spans[-1]) == len(audio)
    for (start, length), (next_start, _) in zip(spans, spans[1:]):
        assert start + length < next_start
        assert not audio[start + length : next_start].any()  # the pause between utterances
    for start, length in spans:
        assert np.abs(audio[start : start + length]).max() > 1000  # speech, not silence


def write_pairs(directory, sentences):
    directory.mkdir()
    for name, pairs in sentences.items():
        for lang, side in (("de", 0), ("en", 1)):
            (directory / f"{name}.{lang}").write_text("".join(p[side] + "\n" for p in pairs))


def test_synthesis_is_seeded_and_independent_of_the_worker_count(corpus, tmp_path):
    _, lines = read_split(corpus, "dev")
    pairs = list(zip(lines["de"], lines["en"]))
    write_pairs(tmp_path / "pairs", {"train": pairs[:2], "valid": pairs[2:3], "test": pairs[3:4]})
    outputs = {}
    for name, seed, workers in (("a", 3, 1), ("b", 3, 2), ("c", 4, 2)):
        synthesize_speech_corpus.main(
            ["--out-dir", str(tmp_path / name), "--pairs-dir", str(tmp_path / "pairs"),
             "--train-size", "2", "--dev-size", "1", "--test-size", "1",
             "--seed", str(seed), "--workers", str(workers)]
        )  # fmt: skip
        yaml_text = (split_dir(tmp_path / name, "train") / "txt" / "train.yaml").read_text()
        wav = (split_dir(tmp_path / name, "train") / "wav" / "ted_1.wav").read_bytes()
        outputs[name] = (yaml_text, wav)
    assert outputs["a"] == outputs["b"]
    assert outputs["a"] != outputs["c"]


def test_max_words_keeps_short_pairs_and_says_when_too_few_are_left(tmp_path):
    pairs = [("Das ist gut.", "That is good."), ("Ein langer Satz.", "This is a rather long one.")]
    write_pairs(tmp_path / "pairs", {"train": pairs * 2})
    assert synthesize_speech_corpus.read_pairs_dir(tmp_path / "pairs", "train", 2, 3) == [
        pairs[0],
        pairs[0],
    ]
    with pytest.raises(SystemExit, match=r"train\.en has 2 usable pairs, 3 requested"):
        synthesize_speech_corpus.read_pairs_dir(tmp_path / "pairs", "train", 3, 3)


def test_synthesis_rejects_missing_sentence_files(tmp_path):
    with pytest.raises(SystemExit, match=r"train\.de not found"):
        synthesize_speech_corpus.main(["--out-dir", str(tmp_path), "--pairs-dir", str(tmp_path)])


def test_synthesis_reports_an_unwritable_out_dir_in_one_line(tmp_path):
    pairs = [("Das ist gut.", "That is good.")]
    write_pairs(tmp_path / "pairs", {"train": pairs, "valid": pairs, "test": pairs})
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "corpus"  # under a regular file: not writable, even for root
    with pytest.raises(SystemExit) as error:
        synthesize_speech_corpus.main(
            ["--out-dir", str(out), "--pairs-dir", str(tmp_path / "pairs"),
             "--train-size", "1", "--dev-size", "1", "--test-size", "1"]
        )  # fmt: skip
    assert error.value.code == f"error: --out-dir: {out}: Not a directory"


# ---------------------------------------------------------------- preparation


def test_prepare_writes_fbank_manifests_vocabularies_and_configs(corpus, fbank_data):
    assert "| all 36 segments kept" in log("prepared_fbank_log")
    for split, size in SIZES.items():
        _, lines = read_split(corpus, split)
        asr = read_manifest(fbank_data / f"{split}_asr.tsv")
        st = read_manifest(fbank_data / f"{split}_st.tsv")
        assert list(asr[0]) == ["id", "audio", "n_frames", "tgt_text", "speaker"]
        assert len(asr) == len(st) == size
        assert [r["id"] for r in asr] == [r["id"] for r in st]
        assert sorted(r["tgt_text"] for r in asr) == sorted(lines["en"])
        assert sorted(r["tgt_text"] for r in st) == sorted(lines["de"])
        assert {r["id"].rsplit("_", 1)[1] for r in asr} == {"0", "1", "2"}  # 3 per talk
    for row in read_manifest(fbank_data / "dev_asr.tsv"):
        features = fairseq_source(row["audio"])
        assert features.shape == (int(row["n_frames"]), 80) and np.isfinite(features).all()
    stats = np.load(fbank_data / "gcmvn.npz")
    assert stats["mean"].shape == stats["std"].shape == (80,) and (stats["std"] > 0).all()


@pytest.mark.parametrize("task", ["asr", "st"])
def test_configs_and_vocabularies_are_what_fairseq_reads(fbank_data, task):
    import sentencepiece as spm
    from fairseq.data import Dictionary
    from fairseq.data.audio.data_cfg import S2TDataConfig

    cfg = S2TDataConfig(fbank_data / f"config_{task}.yaml")
    assert cfg.input_feat_per_channel == 80 and not cfg.use_audio_input
    assert cfg.get_feature_transforms(f"train_{task}", True)["feature_transforms"] == [
        "global_cmvn",
        "specaugment",
    ]
    assert cfg.get_feature_transforms(f"dev_{task}", False)["feature_transforms"] == ["global_cmvn"]
    assert os.path.isfile(cfg.global_cmvn_stats_npz)
    model = spm.SentencePieceProcessor(model_file=cfg.bpe_tokenizer["sentencepiece_model"])
    dictionary = Dictionary.load(str(fbank_data / cfg.vocab_filename))
    # fairseq's dictionary and the sentencepiece model agree on every id
    assert len(dictionary) == model.get_piece_size()
    assert all(dictionary[i] == model.id_to_piece(i) for i in range(4, len(dictionary)))
    assert (model.unk_id(), model.pad_id(), model.eos_id(), model.bos_id()) == (3, 1, 2, 0)


def test_wav_manifests_give_fairseq_the_same_filterbanks(fbank_data, wav_data):
    fbank_rows = {r["id"]: r for r in read_manifest(fbank_data / "dev_asr.tsv")}
    wav_rows = read_manifest(wav_data / "dev_asr.tsv")
    assert len(wav_rows) == len(fbank_rows)
    for row in wav_rows:
        assert row["audio"].split(":")[0].endswith("wav16k.zip")  # segments cut from talks
        online = fairseq_source(row["audio"])  # fairseq computes the fbank while loading
        stored = fairseq_source(fbank_rows[row["id"]]["audio"])
        assert online.shape[0] == int(row["n_frames"]) == int(fbank_rows[row["id"]]["n_frames"])
        np.testing.assert_allclose(online, stored, atol=1e-4)
    assert "use_audio_input" not in yaml.safe_load((wav_data / "config_asr.yaml").read_text())


def copy_corpus(corpus, destination):
    shutil.copytree(corpus, destination)
    return destination


def prepare(root, out, *extra):
    prepare_mustc.main(
        ["--mustc-root", str(root), "--out-dir", str(out), "--vocab-size", "100",
         "--splits", "train", "dev", "--audio-format", "wav", "--workers", "1", *map(str, extra)]
    )  # fmt: skip


def test_whole_file_segments_are_read_in_place_and_waveform_input(corpus, tmp_path):
    root = copy_corpus(corpus, tmp_path / "corpus")
    txt = split_dir(root, "dev") / "txt"
    first = (txt / "dev.yaml").read_text().splitlines()[0]
    wav_name = yaml.safe_load(first)[0]["wav"]
    whole_seconds = sf.info(str(split_dir(root, "dev") / "wav" / wav_name)).duration
    (txt / "dev.yaml").write_text(
        f"- {{duration: {whole_seconds:.6f}, offset: 0.0, speaker_id: s, wav: {wav_name}}}\n"
    )
    for lang in ("en", "de"):
        (txt / f"dev.{lang}").write_text((txt / f"dev.{lang}").read_text().splitlines()[0] + "\n")
    prepare(root, tmp_path / "out", "--waveform-input", "--tasks", "asr")
    (row,) = read_manifest(tmp_path / "out" / "dev_asr.tsv")
    assert row["audio"] == str(split_dir(root, "dev") / "wav" / wav_name)
    waveform = fairseq_source(row["audio"], need_waveform=True)
    assert waveform.ndim == 1 and len(waveform) == int(row["n_frames"])
    config = yaml.safe_load((tmp_path / "out" / "config_asr.yaml").read_text())
    assert config["use_audio_input"] is True and "feature_transforms" not in config


@pytest.fixture
def damaged_corpus(corpus, tmp_path):
    """A copy of the corpus with dev's first talk missing (dev.yaml lines 1-3), train's last talk
    corrupt (train.yaml lines 22-24), an empty translation (dev.de line 5) and a segment that
    starts after the end of its talk (dev.yaml line 6)."""
    root = copy_corpus(corpus, tmp_path / "corpus")
    dev, train = split_dir(root, "dev"), split_dir(root, "train")
    dev_segments, _ = read_split(root, "dev")
    os.remove(dev / "wav" / dev_segments[0]["wav"])
    train_segments, _ = read_split(root, "train")
    (train / "wav" / train_segments[-1]["wav"]).write_bytes(b"RIFF not really a wav")
    de = (dev / "txt" / "dev.de").read_text().splitlines()
    de[4] = "  "
    (dev / "txt" / "dev.de").write_text("\n".join(de) + "\n")
    yaml_lines = (dev / "txt" / "dev.yaml").read_text().splitlines()
    yaml_lines[5] = yaml_lines[5].replace("offset: ", "offset: 9")
    (dev / "txt" / "dev.yaml").write_text("\n".join(yaml_lines) + "\n")
    return root


def test_bad_segments_are_reported_with_file_and_line_and_counted(damaged_corpus, tmp_path, capsys):
    prepare(damaged_corpus, tmp_path / "out")
    out = capsys.readouterr().out
    dev_yaml = split_dir(damaged_corpus, "dev") / "txt" / "dev.yaml"
    train_yaml = split_dir(damaged_corpus, "train") / "txt" / "train.yaml"
    for line in (1, 2, 3):
        assert f"| dropped {dev_yaml}:{line}: missing audio" in out
    for line in (22, 23, 24):
        assert f"| dropped {train_yaml}:{line}: unreadable audio" in out
    assert f"| dropped {dev_yaml}:6: outside the audio" in out
    dev_de = split_dir(damaged_corpus, "dev") / "txt" / "dev.de"
    assert f"| dropped {dev_de}:5: empty transcript (st only)" in out
    assert (
        "| dropped 8 of 30 segments: 1 empty transcript (st), 3 missing audio, "
        "1 outside the audio, 3 unreadable audio" in out
    )
    assert len(read_manifest(tmp_path / "out" / "train_asr.tsv")) == 21
    assert len(read_manifest(tmp_path / "out" / "dev_asr.tsv")) == 2
    assert len(read_manifest(tmp_path / "out" / "dev_st.tsv")) == 1


def test_strict_makes_any_dropped_segment_an_error(damaged_corpus, tmp_path):
    with pytest.raises(SystemExit, match="8 segments dropped and --strict was given"):
        prepare(damaged_corpus, tmp_path / "out", "--strict")


def test_files_that_disagree_are_an_error_naming_file_and_line(corpus, tmp_path):
    root = copy_corpus(corpus, tmp_path / "corpus")
    en = split_dir(root, "dev") / "txt" / "dev.en"
    en.write_text("".join(line + "\n" for line in en.read_text().splitlines()[:-1]))
    dev_yaml = split_dir(root, "dev") / "txt" / "dev.yaml"
    with pytest.raises(SystemExit) as error:
        prepare(root, tmp_path / "out")
    assert f"{en} has 5 lines but {dev_yaml} has 6 segments" in str(error.value)
    assert f"the segment at {dev_yaml}:6 has no line" in str(error.value)


def test_malformed_yaml_is_an_error_naming_file_and_line(corpus, tmp_path):
    root = copy_corpus(corpus, tmp_path / "corpus")
    dev_yaml = split_dir(root, "dev") / "txt" / "dev.yaml"
    lines = dev_yaml.read_text().splitlines()
    lines[2] = lines[2].replace("duration: ", "duration: x")
    dev_yaml.write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit, match=rf"{dev_yaml}:3: duration 'x[\d.]+' is not a number"):
        prepare(root, tmp_path / "out")


def test_an_unwritable_out_dir_is_one_line_before_any_audio_is_read(corpus, tmp_path):
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "out"
    with pytest.raises(SystemExit) as error:
        prepare(corpus, out)
    assert error.value.code == f"error: --out-dir: {out}: Not a directory"


def test_an_unreadable_transcript_is_one_line_naming_it(corpus, tmp_path):
    root = copy_corpus(corpus, tmp_path / "corpus")
    de = split_dir(root, "dev") / "txt" / "dev.de"
    de.write_bytes(b"Gut.\n\xff\xfe kein UTF-8\n")
    with pytest.raises(SystemExit) as error:
        prepare(root, tmp_path / "out")
    assert error.value.code == f"error: {de}:2: not UTF-8 text (byte 0xff)"
    (split_dir(root, "train") / "txt" / "train.en").unlink()
    (split_dir(root, "train") / "txt" / "train.en").mkdir()  # a folder where a file belongs
    with pytest.raises(SystemExit, match=r"train\.en: file not found"):
        prepare(root, tmp_path / "out")


def test_missing_language_directory_is_named(tmp_path):
    with pytest.raises(SystemExit, match=rf"{tmp_path}/en-it: not found"):
        prepare_mustc.main(["--mustc-root", str(tmp_path), "--lang", "it"])


def test_a_vocabulary_smaller_than_the_alphabet_is_a_clear_error(corpus, tmp_path):
    with pytest.raises(
        SystemExit,
        match=r"spm_unigram20_asr failed \(--vocab-type unigram --vocab-size 20\).*smaller than required_chars",
    ):
        prepare(corpus, tmp_path / "out", "--vocab-size", "20", "--tasks", "asr")
