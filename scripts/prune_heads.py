#!/usr/bin/env python3
"""Remove the heads whose gates are closed from a checkpoint trained with --head-gates.

    python scripts/prune_heads.py checkpoints/gated/checkpoint_best.pt pruned.pt
    fairseq-generate data-bin --user-dir local_attn_fairseq --path pruned.pt ...

The pruned checkpoint has smaller attention matrices and no gates, needs no extra options to load,
and translates as the gated model does at test time. Continue training it with --reset-optimizer.
The output must differ from the input; it is written to a temporary file and renamed into place.
"""

import argparse

from local_attn_fairseq.modules.head_pruning import heads_table, prune_checkpoint


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="checkpoint of a model trained with --head-gates")
    parser.add_argument("output", help="where to write the pruned checkpoint")
    args = parser.parse_args(argv)
    try:
        before, after, (params_before, params_after) = prune_checkpoint(
            args.checkpoint, args.output
        )
    except ValueError as e:
        parser.error(str(e))
    print(heads_table(before, after))
    print(f"model parameters: {params_before:,} -> {params_after:,} (written to {args.output})")


if __name__ == "__main__":
    main()
