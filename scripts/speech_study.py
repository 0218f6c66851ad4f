#!/usr/bin/env python3
"""The speech study (``local_attn_fairseq.experiments.speech_study``)."""

from local_attn_fairseq.experiments.speech_study import main

if __name__ == "__main__":
    main()
