#!/usr/bin/env python3
"""The speech demo (``local_attn_fairseq.experiments.speech_demo``)."""

from local_attn_fairseq.experiments.speech_demo import main

if __name__ == "__main__":
    main()
