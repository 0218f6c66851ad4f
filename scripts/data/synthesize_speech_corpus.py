#!/usr/bin/env python3
"""A synthetic speech corpus in MuST-C's layout, spoken by espeak-ng (``local_attn_fairseq.data.speech_corpus``)."""

from local_attn_fairseq.data.speech_corpus import main

if __name__ == "__main__":
    main()
