"""prepare_mustc.py's outputs are one run's set: a failed, interrupted or narrower re-run never
leaves manifests that address another run's features, nor replaces files it did not write."""

import os

import numpy as np
import pytest
import soundfile as sf

from local_attn_fairseq.data import mustc
from local_attn_fairseq.file_safety import OWNER_MARKER

from ..conftest import kill_sentencepiece, run_script, snapshot

PREPARER = os.path.join("scripts", "data", "prepare_mustc.py")
# (talk, [segment seconds]): the 3 s training segments (~300 frames) fall to --max-frames 200.
TALKS = {
    "train": [("ted_1", [1.0, 3.0, 1.2]), ("ted_2", [3.0, 1.1])],
    "dev": [("ted_3", [1.0, 1.3])],
    "tst-COMMON": [("ted_4", [1.2, 0.9])],
}
WORDS = "the cat sat on a mat and then it ran off".split()


def tiny_mustc(root):
    """A MuST-C-like corpus: noise talks at 16 kHz, segments back to back, short texts."""
    rng = np.random.default_rng(0)
    for split, talks in TALKS.items():
        data = root / "en-de" / "data" / split
        (data / "wav").mkdir(parents=True)
        (data / "txt").mkdir()
        yaml_lines, en, de = [], [], []
        for talk, seconds in talks:
            samples = rng.uniform(-0.3, 0.3, int(16000 * sum(seconds)))
            sf.write(data / "wav" / f"{talk}.wav", samples, 16000, subtype="PCM_16")
            offset = 0.0
            for duration in seconds:
                yaml_lines.append(
                    f"- {{duration: {duration}, offset: {offset:.2f}, speaker_id: s, "
                    f"wav: {talk}.wav}}"
                )
                words = " ".join(rng.choice(WORDS, 4))
                en.append(words)
                de.append(words.upper())
                offset += duration
        for name, lines in (("yaml", yaml_lines), ("en", en), ("de", de)):
            (data / "txt" / f"{split}.{name}").write_text("".join(f"{x}\n" for x in lines))
    return root


@pytest.fixture
def corpus(tmp_path):
    return tiny_mustc(tmp_path / "corpus")


def prepare(corpus, out, *extra, expect_success=True):
    args = ["--mustc-root", corpus, "--lang", "de", "--vocab-size", 60, "--workers", 1]
    proc = run_script(PREPARER, *args, *(["--out-dir", out] if out else []), *extra)
    assert (proc.returncode == 0) == expect_success, proc.stdout + proc.stderr
    return proc


def read_rows(out):
    """{(manifest, id): (n_frames, features as fairseq reads them, or the error)}."""
    from fairseq.data.audio.audio_utils import get_features_or_waveform

    rows = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".tsv"):
            for row in mustc.read_manifest(os.path.join(out, name)):
                try:
                    features = get_features_or_waveform(row["audio"])
                except Exception as error:  # an address past the zip's end, a broken header
                    features = repr(error)
                rows[name, row["id"]] = (int(row["n_frames"]), features)
    return rows


def assert_same_features(rows, reference):
    for key, (n_frames, features) in rows.items():
        assert not isinstance(features, str), f"{key}: {features}"
        assert features.shape == (n_frames, 80), key
        np.testing.assert_array_equal(features, reference[key][1], err_msg=str(key))


def test_a_refused_strict_rerun_leaves_the_first_runs_set_whole(corpus, tmp_path):
    out = tmp_path / "out"
    prepare(corpus, out)
    before, rows = snapshot(out), read_rows(out)
    assert len(rows) == 2 * 9  # every segment, ASR and ST
    proc = prepare(corpus, out, "--strict", "--max-frames", "200", expect_success=False)
    assert "2 segments dropped and --strict was given" in proc.stderr
    assert_same_features(read_rows(out), rows)
    assert snapshot(out) == before  # nothing replaced, no staging folder left


def test_a_narrower_rerun_leaves_no_file_of_the_earlier_run(corpus, tmp_path):
    out = tmp_path / "out"
    prepare(corpus, out, "--cmvn", "global")
    first = read_rows(out)
    (out / "notes.txt").write_text("a user's")
    (out / "tst-COMMON_shuffled_st.tsv").write_text("another tool's\n")
    prepare(corpus, out, "--splits", "train", "dev", "--max-frames", "200", "--vocab-size", 50)
    assert sorted(n for n in os.listdir(out) if not n.startswith(".")) == [
        "config_asr.yaml", "config_st.yaml", "dev_asr.tsv",
        "dev_st.tsv", "fbank80.zip", "notes.txt", "spm_unigram50_asr.model",
        "spm_unigram50_asr.txt", "spm_unigram50_asr.vocab", "spm_unigram50_st.model",
        "spm_unigram50_st.txt", "spm_unigram50_st.vocab", "train_asr.tsv", "train_st.tsv",
        "tst-COMMON_shuffled_st.tsv",
    ]  # fmt: skip  (no tst-COMMON manifests, spm_unigram60_*, gcmvn.npz of the first run)
    assert (out / "notes.txt").read_text() == "a user's"
    assert (out / "tst-COMMON_shuffled_st.tsv").read_text() == "another tool's\n"
    rows = {k: v for k, v in read_rows(out).items() if "shuffled" not in k[0]}
    assert len(rows) == 2 * (3 + 2)  # the two 3 s training segments are dropped
    assert_same_features(rows, first)


def kill_savez(monkeypatch):
    def killed(file, **_):
        (open(file, "wb") if isinstance(file, (str, os.PathLike)) else file).write(b"PK half")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", killed)


@pytest.mark.parametrize("kill", [kill_sentencepiece, kill_savez])
def test_an_interrupted_rerun_leaves_the_previous_set_whole(corpus, tmp_path, monkeypatch, kill):
    out = tmp_path / "out"
    prepare(corpus, out, "--cmvn", "global")
    before, rows = snapshot(out), read_rows(out)
    kill(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        prepare(corpus, out, "--cmvn", "global", "--max-frames", "200")
    assert snapshot(out) == before
    assert_same_features(read_rows(out), rows)


def test_a_kill_while_moving_the_set_in_leaves_no_config_and_agreeing_manifests(
    corpus, tmp_path, monkeypatch
):
    out = tmp_path / "out"
    prepare(corpus, out)
    first = read_rows(out)
    replace = os.replace

    def killed_at_the_configs(source, destination):  # as the set is moved into `out`
        if os.path.dirname(destination) == str(out) and "config_" in destination:
            raise KeyboardInterrupt
        replace(source, destination)

    monkeypatch.setattr(os, "replace", killed_at_the_configs)
    with pytest.raises(KeyboardInterrupt):
        prepare(corpus, out, "--splits", "train", "dev", "--max-frames", "200")
    monkeypatch.undo()
    assert not [n for n in os.listdir(out) if n.startswith("config_")]  # not usable, and says so
    rows = read_rows(out)
    assert {name for name, _ in rows} == {"train_asr.tsv", "train_st.tsv", "dev_asr.tsv",
                                          "dev_st.tsv"}  # fmt: skip
    assert_same_features(rows, first)
    prepare(corpus, out)  # the next run completes the folder
    assert_same_features(read_rows(out), first)
    assert mustc.STAGING not in os.listdir(out)


def test_files_rewritten_by_another_tool_in_mustcs_folder_are_refused(corpus):
    lang_dir = corpus / "en-de"
    prepare(corpus, None)  # into ROOT/en-LANG, beside the corpus
    prepare(corpus, None, "--max-frames", "200")  # its own files: replaced
    (lang_dir / "train_asr.tsv").write_text("id\taudio\n")  # fairseq's own preparation
    (lang_dir / "config_st.yaml").write_text("fairseq's\n")
    before = snapshot(lang_dir)
    proc = prepare(corpus, None, expect_success=False)
    assert "already holds train_asr.tsv, config_st.yaml, not written by" in proc.stderr
    assert snapshot(lang_dir) == before
    prepare(corpus, None, "--overwrite")
    assert len(read_rows(lang_dir)) == 2 * 9
    assert OWNER_MARKER not in os.listdir(lang_dir)  # the folder stays the user's


def test_vocabularies_and_cmvn_statistics_are_written_atomically(tmp_path, monkeypatch):
    prefix = str(tmp_path / "spm_unigram60_asr")
    mustc.train_vocabulary(["the cat sat", "on a mat"], prefix, "unigram", 60)
    cmvn = mustc.GlobalCmvn(10)
    cmvn.add(np.ones((5, 80), dtype=np.float32))
    cmvn.save(str(tmp_path / "gcmvn.npz"))
    before = snapshot(tmp_path)
    kill_sentencepiece(monkeypatch)
    kill_savez(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        mustc.train_vocabulary(["other text"], prefix, "unigram", 60)
    with pytest.raises(KeyboardInterrupt):
        cmvn.save(str(tmp_path / "gcmvn.npz"))
    assert snapshot(tmp_path) == before  # no truncated file, no temporary left
