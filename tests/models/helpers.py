"""Build plugin models through fairseq's own argument parsing, as fairseq-train does."""

from fairseq import options, tasks

from ..conftest import USER_DIR


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
