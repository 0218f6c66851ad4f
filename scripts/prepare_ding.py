#!/usr/bin/env python3
"""German-English sentence pairs from Debian's Ding dictionary (``local_attn_fairseq.data.ding``)."""

from local_attn_fairseq.data.ding import main

if __name__ == "__main__":
    main()
