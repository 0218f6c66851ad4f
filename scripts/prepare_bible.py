#!/usr/bin/env python3
"""English-Spanish verse pairs from Debian's SWORD Bibles (``local_attn_fairseq.data.bible``)."""

from local_attn_fairseq.data.bible import main

if __name__ == "__main__":
    main()
