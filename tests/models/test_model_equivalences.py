"""Model-level properties through fairseq's model API: padding and incremental decoding."""

import torch

from .helpers import build_model
from .test_fairseq_cli import DECODER_LOCAL, TINY_MODEL


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
    model.eval()
    src = tokens(task, "Das ist ein gutes Buch .")[0][None]
    tgt_dict = task.target_dictionary
    prev = torch.cat(
        [torch.tensor([[tgt_dict.eos()]]), tokens(task, "This is a good book .")[0][None, :-1]], 1
    )
    with torch.no_grad():
        enc = model.encoder(src, src_lengths=torch.tensor([src.size(1)]))
        full, _ = model.decoder(prev, encoder_out=enc)
        state = {}
        steps = [
            model.decoder(prev[:, : t + 1], encoder_out=enc, incremental_state=state)[0]
            for t in range(prev.size(1))
        ]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)
