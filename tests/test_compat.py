"""Each shim of local_attn_fairseq.compat, with the failure it prevents shown first."""

import argparse
import logging
import os
import pickle
import shutil
import sys

import numpy as np
import pytest
import torch
from fairseq import checkpoint_utils

from local_attn_fairseq import checkpoint_files, compat


def test_plain_torch_load_refuses_a_fairseq_checkpoint(trained_checkpoint):
    with pytest.raises(pickle.UnpicklingError):
        torch.load(trained_checkpoint)  # torch>=2.6: weights_only=True


def test_fairseq_loads_its_checkpoint_with_the_shim(trained_checkpoint):
    state = checkpoint_utils.load_checkpoint_to_cpu(str(trained_checkpoint))
    assert state["cfg"]["model"].arch == "transformer_local_tied"
    assert any(k.startswith("encoder.layers.0.self_attn.q_proj") for k in state["model"])


def test_fairseq_fails_without_the_shim(trained_checkpoint, monkeypatch):
    monkeypatch.setattr(checkpoint_utils, "torch", torch)
    with pytest.raises(pickle.UnpicklingError):
        checkpoint_utils.load_checkpoint_to_cpu(str(trained_checkpoint))


def test_shim_leaves_torch_load_safe_elsewhere():
    compat.apply()
    assert torch.load is checkpoint_utils.torch._torch.load
    assert checkpoint_utils.torch.load is not torch.load


def test_fairseq_audio_conversion_uses_the_sox_replacement():
    from fairseq.data.audio.audio_utils import convert_waveform

    t = np.arange(16000) / 16000
    stereo = np.stack([0.2 * np.sin(2 * np.pi * 440 * t), 0.1 * np.sin(2 * np.pi * 440 * t)])
    out, rate = convert_waveform(
        stereo.astype(np.float32), 16000, normalize_volume=True, to_mono=True, to_sample_rate=8000
    )
    assert rate == 8000 and out.shape == (1, 8000)
    assert abs(np.abs(out).max() - 0.15 / 0.2) < 0.02  # peak-normalised, then averaged


def test_audio_conversion_fails_without_the_sox_replacement(monkeypatch):
    from fairseq.data.audio.audio_utils import convert_waveform

    monkeypatch.setitem(sys.modules, "torchaudio.sox_effects", None)
    with pytest.raises(ImportError):
        convert_waveform(np.zeros((1, 100), dtype=np.float32), 16000, to_sample_rate=8000)


def test_unsupported_sox_effect_is_a_clear_error():
    with pytest.raises(ValueError, match="replacement supports only"):
        compat.apply_effects_tensor(torch.zeros(1, 10), 16000, [["reverb", "50"]])


def _eos_blocks():
    from fairseq.data import TokenBlockDataset

    items = [torch.tensor([5, 6, 2]), torch.tensor([7, 2])]
    return TokenBlockDataset(items, [3, 2], block_size=None, pad=1, eos=2, break_mode="eos")


def test_eos_token_blocks_use_the_numpy_compat_replacement():
    assert [b.tolist() for b in _eos_blocks()] == [[5, 6, 2], [7, 2]]


def test_eos_token_blocks_fail_without_numpy_compat(monkeypatch):
    monkeypatch.delattr(np, "compat")
    with pytest.raises(AttributeError, match="compat"):
        _eos_blocks()


def _write_state(path, epoch, updates):
    history, extra = [{"num_updates": updates}], {"train_iterator": {"epoch": epoch}}
    torch.save({"optimizer_history": history, "extra_state": extra}, path)


def _copy_half_then_fail(src, dst, *args, **kwargs):
    data = open(src, "rb").read()
    with open(dst, "wb") as out:
        out.write(data[: len(data) // 2])
    raise OSError("killed during the copy")


def test_fairseq_checkpoint_copy_leaves_a_truncated_file(tmp_path, monkeypatch):
    from fairseq.file_io import PathManager

    _write_state(tmp_path / "new.pt", 1, 2)
    _write_state(tmp_path / "checkpoint_last.pt", 1, 1)
    monkeypatch.setattr(shutil, "copyfile", _copy_half_then_fail)
    with pytest.raises(OSError):
        PathManager.copy(str(tmp_path / "new.pt"), str(tmp_path / "checkpoint_last.pt"), True)
    with pytest.raises(checkpoint_files.UnreadableCheckpointError):
        checkpoint_files.read_checkpoint(str(tmp_path / "checkpoint_last.pt"))


def test_checkpoint_copy_is_atomic_with_the_shim(tmp_path, monkeypatch):
    _write_state(tmp_path / "new.pt", 1, 2)
    _write_state(tmp_path / "checkpoint_last.pt", 1, 1)
    copy = checkpoint_utils.PathManager.copy
    monkeypatch.setattr(shutil, "copyfile", _copy_half_then_fail)
    with pytest.raises(OSError):
        copy(str(tmp_path / "new.pt"), str(tmp_path / "checkpoint_last.pt"), overwrite=True)
    last = checkpoint_files.read_checkpoint(str(tmp_path / "checkpoint_last.pt"))
    assert checkpoint_files.training_position(last) == (1, 1)  # the old file, whole
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_last.pt", "new.pt"]  # no temporary left
    monkeypatch.undo()
    assert copy(str(tmp_path / "new.pt"), str(tmp_path / "checkpoint_last.pt"), overwrite=True)
    last = checkpoint_files.read_checkpoint(str(tmp_path / "checkpoint_last.pt"))
    assert checkpoint_files.training_position(last) == (1, 2)


def test_checkpoint_write_is_atomic_with_the_shim(tmp_path, monkeypatch):
    target = tmp_path / "checkpoint_best.pt"
    _write_state(target, 1, 1)

    def write_half_then_fail(obj, handle):
        handle.write(b"PK\x03\x04 half a checkpoint")
        raise OSError("killed during the write")

    monkeypatch.setattr(checkpoint_utils, "_torch_persistent_save", write_half_then_fail)
    with pytest.raises(OSError):
        checkpoint_utils.torch_persistent_save({"new": 1}, str(target))
    kept = checkpoint_files.read_checkpoint(str(target))
    assert checkpoint_files.training_position(kept) == (1, 1)
    assert os.listdir(tmp_path) == ["checkpoint_best.pt"]
    monkeypatch.undo()
    checkpoint_utils.torch_persistent_save({"new": 1}, str(target))
    assert checkpoint_files.read_checkpoint(str(target)) == {"new": 1}


def test_newest_intact_checkpoint_skips_unreadable_files(tmp_path):
    _write_state(tmp_path / "checkpoint_1_5.pt", 1, 5)
    _write_state(tmp_path / "checkpoint2.pt", 3, 9)
    _write_state(tmp_path / "checkpoint_best.pt", 2, 7)
    (tmp_path / "checkpoint_3_12.pt").write_bytes(b"")  # the newest, but empty
    (tmp_path / ".checkpoint_last.pt.abc.tmp").write_bytes(b"half")  # a killed write
    newest = checkpoint_files.newest_intact_checkpoint(str(tmp_path))
    assert newest == str(tmp_path / "checkpoint2.pt")
    for name in ("checkpoint2.pt", "checkpoint_best.pt", "checkpoint_1_5.pt"):
        os.remove(tmp_path / name)
    assert checkpoint_files.newest_intact_checkpoint(str(tmp_path)) is None


def _checkpoint_options(save_dir, **changes):
    options = dict(
        save_dir=str(save_dir), restore_file="checkpoint_last.pt", finetune_from_model=None,
        continue_once=None,
    )  # fmt: skip
    options.update(changes)
    return argparse.Namespace(**options)


def test_resume_falls_back_only_from_checkpoint_last(tmp_path):
    _write_state(tmp_path / "checkpoint_1_5.pt", 1, 5)
    (tmp_path / "checkpoint_last.pt").write_bytes(b"PK\x03\x04 truncated")
    source = checkpoint_files.resume_source(_checkpoint_options(tmp_path))
    assert source.path == str(tmp_path / "checkpoint_1_5.pt")
    assert source.unreadable == str(tmp_path / "checkpoint_last.pt")
    cfg = checkpoint_files.with_restore_file(_checkpoint_options(tmp_path), source)
    assert cfg.restore_file == source.path and cfg.finetune_from_model is None
    explicit = _checkpoint_options(tmp_path, restore_file=str(tmp_path / "checkpoint_last.pt"))
    with pytest.raises(checkpoint_files.UnreadableCheckpointError, match="--restore-file"):
        checkpoint_files.resume_source(explicit)
    assert checkpoint_files.resume_source(_checkpoint_options(tmp_path / "new")) is None


def test_fairseq_train_main_marks_the_run(monkeypatch):
    from fairseq_cli import train

    compat.apply()
    assert train.main is compat._train_main_as_marked_run
    assert pickle.loads(pickle.dumps(train.main)) is train.main  # distributed runs pickle it
    monkeypatch.setattr(
        compat, "_original_train_main", lambda cfg: checkpoint_files.current_fairseq_train_run()
    )
    cfg = argparse.Namespace(checkpoint=argparse.Namespace(save_dir="somewhere"))
    assert train.main(cfg) is cfg.checkpoint
    assert checkpoint_files.current_fairseq_train_run() is None


def _blocked_after(block, generated, buffer_length=8, pad=1, vocab=10):
    """The tokens the blocker bans next for one hypothesis that generated ``generated`` (its
    first token the start of sentence) in a token buffer padded to ``buffer_length``."""
    tokens = torch.full((1, buffer_length), pad)
    tokens[0, : len(generated)] = torch.tensor(generated)
    lprobs = block(tokens, torch.zeros(1, vocab), bsz=1, beam_size=1, step=len(generated) - 1)
    return set(torch.isneginf(lprobs[0]).nonzero().flatten().tolist())


def test_fairseq_ngram_blocker_looks_at_the_padding(monkeypatch):
    from fairseq.ngram_repeat_block import NGramRepeatBlock

    compat.apply()
    monkeypatch.setattr(NGramRepeatBlock, "_no_repeat_ngram", compat._original_no_repeat_ngram)
    assert _blocked_after(NGramRepeatBlock(2, use_extension=False), [2, 5, 6, 5]) == set()


def test_ngram_blocker_bans_repeats_of_the_generated_tokens_with_the_shim():
    from fairseq.ngram_repeat_block import NGramRepeatBlock

    compat.apply()
    bigrams, trigrams = NGramRepeatBlock(2, use_extension=False), NGramRepeatBlock(3, False)
    assert _blocked_after(bigrams, [2, 5, 6, 5]) == {6}  # 5 6 was generated
    assert _blocked_after(bigrams, [2, 5, 6, 5, 7, 5]) == {6, 7}
    assert _blocked_after(trigrams, [2, 5, 6, 7, 5, 6]) == {7}
    assert _blocked_after(trigrams, [2, 5, 6, 7, 6, 5]) == set()
    assert _blocked_after(bigrams, [2, 5, 6, 5], buffer_length=4) == {6}  # no padding at all


def _batches(n, monkeypatch, **options):
    from fairseq.data import data_utils

    compat.apply()
    monkeypatch.setattr(compat, "_dropped_batches_said", set())
    return data_utils.batch_by_size(np.arange(n), lambda i: 5, **options)


def test_fairseq_batching_leaves_out_a_last_batch_silently(caplog):
    compat.apply()
    caplog.set_level(logging.DEBUG)
    batches = compat._original_batch_by_size(
        np.arange(40), lambda i: 5, max_sentences=1, required_batch_size_multiple=8
    )
    assert sum(len(b) for b in batches) == 39
    assert not caplog.records


def test_what_batching_leaves_out_is_said_once_with_the_shim(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger=compat.__name__)
    batches = _batches(40, monkeypatch, max_sentences=1, required_batch_size_multiple=8)
    assert sum(len(b) for b in batches) == 39  # the batches are fairseq's
    [record] = caplog.records
    assert "leaves out 1 of 40 examples" in record.getMessage()
    assert "--required-batch-size-multiple 1" in record.getMessage()
    from fairseq.data import data_utils

    data_utils.batch_by_size(np.arange(40), lambda i: 5, max_sentences=1,
                             required_batch_size_multiple=8)  # fmt: skip
    assert len(caplog.records) == 1  # said once
    caplog.clear()
    whole = _batches(40, monkeypatch, max_tokens=50, required_batch_size_multiple=8)
    assert sum(map(len, whole)) == 40
    assert sum(map(len, _batches(37, monkeypatch, max_sentences=1))) == 37
    assert not caplog.records
