"""The speech encoder's counted and measured cost: attention pairs, operations, the subsampler's
lengths, and the side-by-side timing of two encoders."""

import time

import pytest
import torch

from local_attn_fairseq.experiments.speech_encoder_cost import (
    attention_keys,
    build_encoder,
    encoder_frames,
    measure,
    self_attention_cost,
)
from local_attn_fairseq.models.s2t_transformer_local import s2t_transformer_local_tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def pairs_by_enumeration(length, window):
    """Every (query, key) pair a head scores, listed one by one."""
    if window == 0:
        return length * length
    half = (window - 1) // 2
    return sum(1 for q in range(length) for k in range(length) if abs(q - k) <= half)


@pytest.mark.parametrize("window", [0, 1, 3, 5, 17, 41])
def test_attention_keys_count_every_pair_of_the_band(window):
    lengths = [1, 2, 3, 8, 20, 33]
    counted = attention_keys(torch.tensor(lengths), window)
    assert counted.tolist() == [pairs_by_enumeration(t, window) for t in lengths]


def test_a_window_wider_than_the_sentence_scores_every_pair():
    assert attention_keys(torch.tensor([7]), 99).item() == 49


def test_encoder_frames_follow_the_models_subsampler():
    encoder, _ = build_encoder("0,0,0,0,0,0", arch=s2t_transformer_local_tiny)
    fbank = torch.tensor([5, 99, 100, 101, 640, 1001])
    expected = encoder.subsample.get_out_seq_lens_tensor(fbank)
    assert encoder_frames(fbank).tolist() == expected.tolist()


def test_self_attention_cost_sums_the_layers():
    d, heads = 64, 4
    fbank = torch.tensor([400, 640])  # 100 and 160 encoder positions
    dense = self_attention_cost(fbank, [0] * 6, d, heads)
    assert dense["encoder_frames"].tolist() == [100, 160]
    assert dense["flops"].tolist() == [6 * 4 * d * t * t for t in (100, 160)]
    assert dense["weight_bytes"].tolist() == [6 * heads * 4 * t * t for t in (100, 160)]
    local = self_attention_cost(fbank, [0, 0, 17, 17, 17, 17], d, heads)
    band = [pairs_by_enumeration(t, 17) for t in (100, 160)]
    assert local["flops"].tolist() == [
        4 * d * (2 * t * t + 4 * b) for t, b in zip((100, 160), band)
    ]


def test_measure_times_both_encoders_on_the_same_batch():
    encoders = {
        w: build_encoder(w, arch=s2t_transformer_local_tiny)[0]
        for w in ("0,0,0,0,0,0", "0,0,3,5,5,7")
    }
    result = measure(encoders, frames=120, batch=2, rounds=2)
    assert set(result) == set(encoders)
    for seconds, peak, busy in result.values():
        assert seconds > 0 and peak > 0 and busy is None


def test_measure_can_take_the_process_cpu_time(monkeypatch):
    encoders = {"global": build_encoder("0,0,0,0,0,0", arch=s2t_transformer_local_tiny)[0]}
    clocks = []
    real_clock = time.process_time

    def counted_clock():
        clocks.append(True)
        return real_clock()

    monkeypatch.setattr(time, "process_time", counted_clock)
    (seconds, _, _), = measure(encoders, frames=60, batch=1, rounds=3, cpu_time=True).values()
    assert seconds > 0 and len(clocks) == 2 * 3  # a start and an end per timed round
    with pytest.raises(ValueError, match="CPU runs only"):
        measure(encoders, frames=60, batch=1, rounds=1, device="cuda", cpu_time=True)
