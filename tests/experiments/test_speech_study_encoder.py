"""The ST runs' encoder: which ASR model it is, by the fingerprint of its weights."""

import os

import pytest
import torch

from local_attn_fairseq.checkpoint_files import weights_fingerprint
from local_attn_fairseq.experiments import speech_study
from local_attn_fairseq.experiments.fairseq_runner import RunFailed


def save_checkpoint(path, weights, **other):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"model": weights, **other}, path)


def weights(seed):
    generator = torch.Generator().manual_seed(seed)
    return {
        "encoder.fc1.weight": torch.randn(4, 3, generator=generator),
        "encoder.version": torch.tensor([3.0]),
        "decoder.step": torch.tensor(7),  # a 0-dim tensor
        "mask": torch.tensor([True, False]),
    }


def test_the_fingerprint_is_of_the_weights_alone(tmp_path):
    save_checkpoint(str(tmp_path / "a.pt"), weights(1), optimizer_history=[{"lr": 1}])
    save_checkpoint(str(tmp_path / "b.pt"), weights(1), extra_state={"training_time": 9.5})
    changed = weights(1)
    changed["encoder.fc1.weight"][2, 1] += 1e-6
    save_checkpoint(str(tmp_path / "c.pt"), changed)
    renamed = {name.replace("fc1", "fc2"): value for name, value in weights(1).items()}
    save_checkpoint(str(tmp_path / "d.pt"), renamed)
    a, b, c, d = (weights_fingerprint(str(tmp_path / f"{n}.pt")) for n in "abcd")
    assert a == b and len(a) == 12 and int(a, 16) >= 0
    assert len({a, c, d}) == 3


class PreparedCorpus:  # what the runs' options read of a prepared corpus
    def __init__(self, work):
        self.work, self.data = str(work), str(work / "data")


def asr_run(tmp_path):
    return speech_study.asr_run(PreparedCorpus(tmp_path), 32)


def test_st_runs_of_another_asr_model_get_other_keys(tmp_path):
    asr = asr_run(tmp_path)
    first = {"updates_to_convergence": 15000, "chosen_windows": "0,0,0,13,19,17"}
    again = dict(first, weights_fingerprint="0123456789ab")
    other = dict(first, weights_fingerprint="ba9876543210")
    paths = [speech_study.encoder_path(asr, record) for record in (first, again, other)]
    # a record without a fingerprint (the first ASR run's) keeps the name by update alone
    assert [os.path.basename(p) for p in paths] == [
        "encoder_for_st_u15000.pt", "encoder_for_st_u15000_0123456789ab.pt",
        "encoder_for_st_u15000_ba9876543210.pt",
    ]  # fmt: skip
    keys = {
        run.key
        for record in (first, again, other)
        for run in speech_study.st_runs(
            PreparedCorpus(tmp_path), speech_study.encoder_path(asr, record),
            record["chosen_windows"], [1], 32,
        )  # fmt: skip
    }
    assert len(keys) == 6  # two arms of three ASR models


def test_the_encoder_is_copied_only_from_the_recorded_asr_model(tmp_path):
    asr = asr_run(tmp_path)
    best = os.path.join(asr.save_dir, "checkpoint_best.pt")
    save_checkpoint(best, weights(1))
    record = {"updates_to_convergence": 8, "weights_fingerprint": weights_fingerprint(best)}
    path = speech_study.copy_encoder(asr, record)
    assert weights_fingerprint(path) == record["weights_fingerprint"]
    assert path.endswith(f"encoder_for_st_u8_{record['weights_fingerprint']}.pt")

    save_checkpoint(best, weights(2))  # the ASR run trained again: other weights
    os.remove(path)
    with pytest.raises(RunFailed, match="is not the recorded ASR model .*move the ASR record"):
        speech_study.copy_encoder(asr, record)
    assert not os.path.exists(path)
