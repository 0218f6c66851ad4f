"""``local-attn-analyze``: the analysis tools, one subcommand each.

    local-attn-analyze sensitivity --path checkpoint.pt --data data-bin ...
    local-attn-analyze contributions --path asr/checkpoint_best.pt --data speech-data ...

Every subcommand lives in its own module of this package, which provides ``HELP`` (one line),
``add_arguments(parser)`` and ``run(args)``; ``run`` writes JSON and PNG files and prints a
short table.
"""

import argparse
import importlib
import sys
from typing import Optional

# subcommand -> module of local_attn_fairseq.analysis
SUBCOMMANDS = {
    "sensitivity": "sensitivity_cli",
    "bias": "attention_bias_cli",
    "heads": "head_roles_cli",
    "windows": "learned_windows_cli",
    "contributions": "contributions_cli",
}


def subcommand_module(name: str):
    return importlib.import_module(f"{__package__}.{SUBCOMMANDS[name]}")


def build_parser(chosen: Optional[str] = None) -> argparse.ArgumentParser:
    """All subcommands, or only the chosen one (which then needs no other module to import)."""
    parser = argparse.ArgumentParser(
        prog="local-attn-analyze",
        description="Analyses of attention locality on fairseq checkpoints; each subcommand "
        "writes JSON and PNG files and prints a short table.",
    )
    subparsers = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
    for name in [chosen] if chosen else SUBCOMMANDS:
        module = subcommand_module(name)
        sub = subparsers.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    args = build_parser(chosen).parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
