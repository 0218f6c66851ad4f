#!/usr/bin/env python3
"""Remove the heads whose gates are closed from a checkpoint trained with --head-gates.

    python scripts/prune_heads.py checkpoints/gated/checkpoint_best.pt pruned.pt
    fairseq-generate data-bin --user-dir local_attn_fairseq --path pruned.pt ...

The pruned checkpoint has smaller attention matrices and no gates, needs no extra options to load,
and translates as the gated model does at test time. Continue training it with --reset-optimizer.
The output must differ from the input; it is written to a temporary file and renamed into place.
An existing file at the output path is replaced only with --overwrite; a missing, empty or
truncated checkpoint is named in one line.
"""

import sys

from local_attn_fairseq.prune_heads import main

if __name__ == "__main__":
    sys.exit(main(description=__doc__.split("\n\n")[0]))
