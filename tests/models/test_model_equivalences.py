"""Model-level properties through fairseq's model API: padding and incremental decoding."""

import torch

from .helpers import assert_incremental_decoding_matches_full_forward, build_model
from ..conftest import TINY_MODEL
from .test_fairseq_cli import DECODER_LOCAL


def tokens(task, *sentences):
    d = task.source_dictionary
    return [d.encode_line(s, add_if_not_exist=False).long() for s in sentences]


def test_left_padded_batch_equals_each_sentence_alone(tiny_data):
    model, task, _ = build_model(tiny_data / "bin", "transformer_local_tied", *TINY_MODEL)
    model.eval()
    pad = task.source_dictionary.pad()
    short, long_ = tokens(task, "Das ist gut .", "Er hat das Buch heute nicht gelesen .")
    batch = torch.full((2, len(long_)), pad)
    batch[0, -len(short) :] = short  # fairseq's default: sources are left-padded
    batch[1] = long_
    lengths = torch.tensor([len(short), len(long_)])
    with torch.no_grad():
        out = model.encoder(batch, src_lengths=lengths)["encoder_out"][0]
        alone = model.encoder(short[None], src_lengths=lengths[:1])["encoder_out"][0]
    torch.testing.assert_close(out[-len(short) :, 0], alone[:, 0], atol=1e-5, rtol=1e-4)
    assert torch.isfinite(out).all()


def test_incremental_decoding_equals_full_forward(tiny_data):
    model, task, _ = build_model(
        tiny_data / "bin", "transformer_local", *TINY_MODEL, "--locality-config", DECODER_LOCAL
    )
    assert_incremental_decoding_matches_full_forward(model, task)
