#!/usr/bin/env python3
"""The demo: baseline vs ``transformer_local_tied`` (``local_attn_fairseq.experiments.demo``)."""

from local_attn_fairseq.experiments.demo import main

if __name__ == "__main__":
    main()
