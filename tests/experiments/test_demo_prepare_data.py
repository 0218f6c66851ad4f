"""demo.prepare_data (the demos, the pruning demo, the small-scale study and the throughput
benchmark) on a small Ding slice: a run killed in any step leaves nothing that a later run takes
for done, and the next run completes the data.

A kill is emulated by raising KeyboardInterrupt inside the step, after it wrote part of its
output.
"""

import os

import pytest
import sentencepiece

from local_attn_fairseq.experiments import demo
from local_attn_fairseq.file_safety import claim_output_dir

VOCAB, MAX_TRAIN, TEST_SIZE = 300, 200, 20


def prepare(work):
    """demo.prepare_data as the Ding demo calls it with these settings."""
    data = demo.data_dir_for(str(work), VOCAB, MAX_TRAIN, TEST_SIZE)
    return data, demo.prepare_data(data, demo.DING_CORPUS, VOCAB, MAX_TRAIN, TEST_SIZE)


def killed(step):
    with pytest.raises(KeyboardInterrupt):
        step()


def line_count(path):
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


@pytest.fixture
def work(tmp_path):
    work = tmp_path / "demo_runs"
    claim_output_dir(str(work), demo.WORK_DIR_OWNER)
    return work


def folders(work):
    data = demo.data_dir_for(str(work), VOCAB, MAX_TRAIN, TEST_SIZE)
    return data, *(os.path.join(data, d) for d in ("raw", "spm", "bin"))


def assert_complete(work):
    """The next run completes the data, every split whole."""
    data, raw, spm, bin_dir = folders(work)
    assert prepare(work)[1] == bin_dir
    for split, size in (("train", MAX_TRAIN), ("test", TEST_SIZE)):
        for lang in ("de", "en"):
            assert line_count(os.path.join(raw, f"{split}.{lang}")) == size
            assert line_count(os.path.join(spm, f"{split}.{lang}")) == size
    assert sorted(os.listdir(data)) == ["bin", "preprocess.log", "raw", "spm"]
    assert not [name for name in os.listdir(spm) if name.startswith(".")]


def test_a_run_killed_while_extracting_extracts_again(work, monkeypatch):
    _, raw, _, _ = folders(work)
    rename = os.replace

    def replace(source, destination, *args, **kwargs):
        if os.path.basename(destination) == "valid.de":  # Ding's test.* are written before it
            raise KeyboardInterrupt
        return rename(source, destination, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(os, "replace", replace)
        killed(lambda: prepare(work))
    assert not os.path.exists(os.path.join(raw, "test.en"))  # no part of a split set is taken
    assert_complete(work)


def test_a_run_killed_while_encoding_encodes_again(work, monkeypatch):
    _, raw, spm, _ = folders(work)
    encode_file, encode = demo.encode_file, sentencepiece.SentencePieceProcessor.encode
    lines_of_last = []

    def encode_file_watched(model, source, out):
        lines_of_last.clear()
        if out.endswith("test.en"):  # the last encoding: 5 lines written, then the kill
            lines_of_last.append(0)
        return encode_file(model, source, out)

    def encode_until_killed(self, *args, **kwargs):
        if lines_of_last:
            lines_of_last[0] += 1
            if lines_of_last[0] > 5:
                raise KeyboardInterrupt
        return encode(self, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(demo, "encode_file", encode_file_watched)
        patched.setattr(sentencepiece.SentencePieceProcessor, "encode", encode_until_killed)
        killed(lambda: prepare(work))
    assert lines_of_last == [6] and line_count(os.path.join(raw, "train.en")) == MAX_TRAIN
    assert not os.path.exists(os.path.join(spm, "test.en"))  # not a truncated encoding
    assert_complete(work)


def test_a_run_killed_in_fairseq_preprocess_binarises_again(work, monkeypatch):
    """Killed once early (dictionaries and part of a .bin written), once at the end (the last
    .bin half written)."""
    _, _, _, bin_dir = folders(work)
    binarise, full = demo.run_captured_in_process, {}

    def preprocess_killed_early(tool, argv, log_path):
        destination = argv[argv.index("--destdir") + 1]
        os.makedirs(destination, exist_ok=True)
        for name in ("dict.de.txt", "dict.en.txt", "train.de-en.de.bin"):
            with open(os.path.join(destination, name), "w") as f:
                f.write("written before the kill\n")
        raise KeyboardInterrupt

    def preprocess_killed_late(tool, argv, log_path):
        binarise(tool, argv, log_path)
        last = os.path.join(argv[argv.index("--destdir") + 1], "test.de-en.en.bin")
        with open(last, "rb") as f:
            full["bin"] = f.read()
        with open(last, "wb") as f:
            f.write(full["bin"][: len(full["bin"]) // 2])
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(demo, "run_captured_in_process", preprocess_killed_early)
        killed(lambda: prepare(work))
    assert not os.path.exists(bin_dir) and not os.path.exists(bin_dir + ".partial")
    with monkeypatch.context() as patched:
        patched.setattr(demo, "run_captured_in_process", preprocess_killed_late)
        killed(lambda: prepare(work))
    assert not os.path.exists(bin_dir) and not os.path.exists(bin_dir + ".partial")
    assert_complete(work)
    with open(os.path.join(bin_dir, "test.de-en.en.bin"), "rb") as f:
        assert f.read() == full["bin"]
