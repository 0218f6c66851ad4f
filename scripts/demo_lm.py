#!/usr/bin/env python3
"""The language-model demo: ``transformer_lm`` vs ``transformer_lm_local`` on the English Bible
as one text (``local_attn_fairseq.experiments.lm_demo``)."""

from local_attn_fairseq.experiments.lm_demo import main

if __name__ == "__main__":
    main()
