"""Each shim of local_attn_fairseq.compat, with the failure it prevents shown first."""

import pickle
import sys

import numpy as np
import pytest
import torch
from fairseq import checkpoint_utils

from local_attn_fairseq import compat


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
