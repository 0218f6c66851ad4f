"""``local-attn-analyze``: the analysis tools, one subcommand each.

    local-attn-analyze sensitivity --path checkpoint.pt --data data-bin ...
    local-attn-analyze contributions --path asr/checkpoint_best.pt --data speech-data ...

Every subcommand is a module of this package, registered in ``SUBCOMMANDS``, which provides
``HELP`` (one line), ``add_arguments(parser)`` (its options: the shared ones come from
``loading``) and ``run(args)``; ``run`` writes JSON and PNG files and prints a short table, and
its input errors are reported in one line (:func:`loading.reports_input_errors`).
"""

import argparse
import sys

from . import (
    attention_bias_cli,
    contributions_cli,
    head_roles_cli,
    learned_windows_cli,
    sensitivity_cli,
)
from .loading import reports_input_errors

SUBCOMMANDS = {
    "sensitivity": sensitivity_cli,
    "bias": attention_bias_cli,
    "heads": head_roles_cli,
    "windows": learned_windows_cli,
    "contributions": contributions_cli,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="local-attn-analyze",
        description="Analyses of attention locality on fairseq checkpoints; each subcommand "
        "writes JSON and PNG files and prints a short table.",
    )
    subparsers = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
    for name, module in SUBCOMMANDS.items():
        subcommand = subparsers.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(subcommand)
        subcommand.set_defaults(run=reports_input_errors(module.run))
    return parser


def main(argv=None):
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
