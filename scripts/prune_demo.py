#!/usr/bin/env python3
"""Pruning encoder heads on the demo data (``local_attn_fairseq.experiments.prune_demo``)."""

from local_attn_fairseq.experiments.prune_demo import main

if __name__ == "__main__":
    main()
