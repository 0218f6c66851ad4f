"""demo.bleu and speech_pipeline.score keep fairseq-generate's output for a checkpoint, and only
a finished decode's: one killed part-way is decoded again instead of failing every later run."""

import logging
import os
import time

import pytest

from local_attn_fairseq.experiments import demo, fairseq_runner, speech_pipeline


def killed_decode(tool, argv, log_path, env=None):
    """fairseq-generate killed part-way: some hypotheses written, no score yet."""
    with open(log_path, "w", encoding="utf-8") as f:
        f.write("S-0\tein Satz .\nH-0\t-0.5\ta sentence .\n")
    raise KeyboardInterrupt


def test_demo_bleu_after_a_killed_decode_decodes_again(tiny_data, trained_checkpoint, tmp_path,
                                                       monkeypatch):  # fmt: skip
    out = tmp_path / "generate-test.txt"
    with monkeypatch.context() as patched:
        patched.setattr(fairseq_runner, "run_tool", killed_decode)
        with pytest.raises(KeyboardInterrupt):
            demo.bleu(str(tiny_data / "bin"), str(trained_checkpoint), str(out))
    assert not out.exists()  # nothing under the name a later run reuses
    score = demo.bleu(str(tiny_data / "bin"), str(trained_checkpoint), str(out))
    assert score >= 0 and "BLEU = " in out.read_text()
    assert sorted(os.listdir(tmp_path)) == ["generate-test.txt"]
    written = out.stat().st_mtime
    assert demo.bleu(str(tiny_data / "bin"), str(trained_checkpoint), str(out)) == score
    assert out.stat().st_mtime == written  # kept while newer than the checkpoint


def test_speech_score_after_a_killed_decode_decodes_again(tmp_path, monkeypatch):
    checkpoint = tmp_path / "checkpoint_best.pt"
    checkpoint.write_bytes(b"a checkpoint")
    past = time.time() - 60
    os.utime(checkpoint, (past, past))
    out = tmp_path / "test" / "generate-tst-COMMON.txt"
    out.parent.mkdir()
    decoded = []

    def decode(tool, argv, log_path, env=None):
        decoded.append(argv)
        with open(log_path, "w", encoding="utf-8") as f:
            f.write("H-0\t-0.5\tsome words\nGenerate tst-COMMON_asr with beam=5: WER: 12.50\n")
        return ""

    # fairseq_runner.kept_output runs fairseq-generate for both
    monkeypatch.setattr(fairseq_runner, "run_tool", killed_decode)
    with pytest.raises(KeyboardInterrupt):
        speech_pipeline.score(str(tmp_path), str(checkpoint), "asr", str(out))
    monkeypatch.setattr(fairseq_runner, "run_tool", decode)
    assert speech_pipeline.score(str(tmp_path), str(checkpoint), "asr", str(out)) == 12.5
    assert speech_pipeline.score(str(tmp_path), str(checkpoint), "asr", str(out)) == 12.5
    assert len(decoded) == 1 and "tst-COMMON_asr" in decoded[0]
    assert os.listdir(out.parent) == ["generate-tst-COMMON.txt"]


def test_a_failed_decode_keeps_its_log_beside_and_nothing_under_the_name(tmp_path, monkeypatch):
    checkpoint = tmp_path / "checkpoint.pt"
    checkpoint.write_bytes(b"")
    out = tmp_path / "generate-test.txt"

    def no_score(tool, argv, log_path, env=None):
        with open(log_path, "w", encoding="utf-8") as f:
            f.write("the decode ended without a score\n")
        return ""

    monkeypatch.setattr(fairseq_runner, "run_tool", no_score)
    with pytest.raises(demo.RunFailed, match="no BLEU score"):
        demo.bleu(str(tmp_path), str(checkpoint), str(out))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.pt", "generate-test.txt.partial"]


def hypotheses(path):
    return sorted(line for line in path.read_text().splitlines() if line.startswith(("S-", "H-")))


def test_a_decode_in_this_process_writes_what_a_child_writes(tiny_data, trained_checkpoint,
                                                            tmp_path, capsys):  # fmt: skip
    """The text demo decodes in its own process once every run has trained: the same score and
    hypotheses as fairseq-generate's own process, in the file only (the console gets the
    command); the process's logging is as it was."""
    data, checkpoint = str(tiny_data / "bin"), str(trained_checkpoint)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    child = demo.bleu(data, checkpoint, str(tmp_path / "child.txt"))
    here = demo.bleu(data, checkpoint, str(tmp_path / "here.txt"), in_process=True)
    assert here == child and hypotheses(tmp_path / "here.txt") == hypotheses(tmp_path / "child.txt")
    assert "BLEU = " in (tmp_path / "here.txt").read_text()
    printed = capsys.readouterr().out
    assert "$ fairseq-generate" in printed and "H-0" not in printed
    assert root.handlers == handlers and root.level == level


def test_a_failed_decode_in_this_process_is_a_run_failure_with_its_log(tiny_data, tmp_path):
    broken = tmp_path / "checkpoint.pt"
    broken.write_bytes(b"")
    out = tmp_path / "generate-test.txt"
    with pytest.raises(demo.RunFailed, match="fairseq-generate failed") as failure:
        demo.bleu(str(tiny_data / "bin"), str(broken), str(out), in_process=True)
    assert "see " + str(out) + ".partial" in str(failure.value)
    assert not out.exists() and (tmp_path / "generate-test.txt.partial").exists()
