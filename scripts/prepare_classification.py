#!/usr/bin/env python3
"""A subject-verb agreement classification set from the Ding corpus (``local_attn_fairseq.data.agreement``)."""

from local_attn_fairseq.data.agreement import main

if __name__ == "__main__":
    main()
