"""Build plugin models through fairseq's own argument parsing, as fairseq-train does."""

import math
import shutil

import torch
from fairseq import options, tasks

from ..conftest import USER_DIR, fairseq_cli


def build_model(data_bin, arch, *extra):
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser, [str(data_bin), "--user-dir", USER_DIR, "--arch", arch, *map(str, extra)]
    )
    task = tasks.setup_task(args)
    return task.build_model(args), task, args


def encoder_attention_weights(model):
    """Weights (no biases) of the encoder self-attention projections, each parameter once."""
    seen, total = set(), 0
    for name, p in model.encoder.named_parameters():
        if ".self_attn." in name and name.endswith("weight") and id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def assert_incremental_decoding_matches_full_forward(model, task):
    """Step-by-step decoding with fairseq's incremental state gives the full pass's outputs."""
    model.eval()
    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    src = src_dict.encode_line("Das ist ein gutes Buch .", add_if_not_exist=False).long()[None]
    tgt = tgt_dict.encode_line("This is a good book .", add_if_not_exist=False).long()
    prev = torch.cat([torch.tensor([tgt_dict.eos()]), tgt[:-1]])[None]
    with torch.no_grad():
        enc = model.encoder(src, src_lengths=torch.tensor([src.size(1)]))
        full, _ = model.decoder(prev, encoder_out=enc)
        state = {}
        steps = [
            model.decoder(prev[:, : t + 1], encoder_out=enc, incremental_state=state)[0]
            for t in range(prev.size(1))
        ]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)


def target_side_lm_data(tiny_data, root):
    """(translation data, LM data): the tiny translation data with its target dictionary as
    dict.txt (where fairseq reads an LM's dictionary for --lm-path and fairseq-interactive), and
    the target side binarised with that dictionary for a language model."""
    small, mt = tiny_data / "small", root / "mt"
    shutil.copytree(tiny_data / "bin", mt)
    shutil.copy(mt / "dict.en.txt", mt / "dict.txt")
    fairseq_cli(
        "fairseq-preprocess", "--only-source", "--trainpref", small / "train.en",
        "--validpref", small / "valid.en", "--srcdict", mt / "dict.en.txt",
        "--destdir", root / "lm-bin", "--workers", 1,
    )  # fmt: skip
    return mt, root / "lm-bin"


def generate(data, checkpoint, *extra):
    proc = fairseq_cli(
        "fairseq-generate",
        data / "bin",
        "--user-dir",
        USER_DIR,
        "--path",
        checkpoint,
        "--gen-subset",
        "test",
        "--beam",
        2,
        "--max-len-b",
        8,
        "--batch-size",
        16,
        "--num-workers",
        0,
        *extra,
    )
    hypotheses = [line for line in proc.stdout.splitlines() if line.startswith("H-")]
    assert len(hypotheses) == 40, proc.stdout[-2000:]
    assert "BLEU" in proc.stdout
    return proc


def ensemble_token_scores(per_model_scores):
    """The token scores fairseq-generate prints for an ensemble (base-2 log of the models' mean
    probability), from each model's printed token scores of the same tokens."""
    natural = torch.tensor(per_model_scores) * math.log(2)
    mean = torch.logsumexp(natural, dim=0) - math.log(len(per_model_scores))
    return (mean / math.log(2)).tolist()
