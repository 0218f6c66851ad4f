"""``python -m local_attn_fairseq`` prints the plugin's directory, the path ``--user-dir`` takes.

fairseq resolves ``--user-dir`` against the working directory, so ``--user-dir
local_attn_fairseq`` works only from the repository root; after ``pip install`` this works from
any folder::

    fairseq-train DATA --user-dir "$(python -m local_attn_fairseq)" --arch transformer_local_tiny
"""

import argparse
import os

PLUGIN_DIR = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m local_attn_fairseq", description=__doc__.split("\n\n")[0]
    )
    parser.parse_args(argv)
    print(PLUGIN_DIR)


if __name__ == "__main__":
    main()
