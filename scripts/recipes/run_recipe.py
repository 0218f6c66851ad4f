#!/usr/bin/env python3
"""Reproduce a row of a paper's results table (``local-attn-recipe``, from
``local_attn_fairseq.recipes.cli``; the same arguments).

    python scripts/recipes/run_recipe.py --list
    python scripts/recipes/run_recipe.py pande_wmt14_en_de --list-rows
    python scripts/recipes/run_recipe.py pande_wmt14_en_de --row "1LocHead 7TiedLoc All6 (i)" \\
        --stage all --work-dir runs/pande_en_de --dry-run
"""

import sys

from local_attn_fairseq.recipes.cli import main

if __name__ == "__main__":
    sys.exit(main())
