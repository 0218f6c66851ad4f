#!/usr/bin/env python3
"""MuST-C (or a corpus in its layout) to fairseq's speech_to_text manifests (``local_attn_fairseq.data.mustc``)."""

from local_attn_fairseq.data.mustc import main

if __name__ == "__main__":
    main()
