#!/usr/bin/env python3
"""The small-scale study (``local_attn_fairseq.experiments.small_scale_study``)."""

from local_attn_fairseq.experiments.small_scale_study import main

if __name__ == "__main__":
    main()
