#!/usr/bin/env python3
"""Average the parameters of the last N checkpoints of a fairseq training run
(``local_attn_fairseq.recipes.averaging``).

    python scripts/recipes/average_checkpoints.py checkpoints/ averaged.pt --last 5
"""

from local_attn_fairseq.recipes.averaging import main

if __name__ == "__main__":
    main()
