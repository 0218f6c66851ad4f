"""fairseq's command-line tools run inside this process: the same parsers and ``main`` functions
``fairseq-train``, ``fairseq-generate``, ``fairseq-eval-lm`` and ``fairseq-preprocess`` run, so a
recipe pays for importing torch and fairseq once, not once per step. Every call prints the
equivalent shell command first, and writes everything fairseq logs to a file as well.
"""

import contextlib
import logging
import os
import shlex
import sys

TOOLS = ("fairseq-preprocess", "fairseq-train", "fairseq-generate", "fairseq-eval-lm")


def command_line(tool, argv):
    return "$ " + " ".join([tool, *(shlex.quote(str(a)) for a in argv)])


@contextlib.contextmanager
def logging_to(path):
    """Also send every log record (fairseq's progress lines included) to ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    handler = logging.FileHandler(path, mode="w", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s | %(levelname)s | %(name)s | %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()


def run(tool, argv, log_path):
    """Run one fairseq tool with ``argv``; returns what its ``main`` returns."""
    argv = [str(a) for a in argv]
    print(command_line(tool, argv), flush=True)
    with logging_to(log_path):
        return _RUNNERS[tool](argv)


def _preprocess(argv):
    from fairseq import options
    from fairseq_cli import preprocess

    args = options.get_preprocessing_parser().parse_args(argv)
    return preprocess.main(args)


def _train(argv):
    from fairseq import distributed_utils, options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq_cli import train

    args = options.parse_args_and_arch(options.get_training_parser(), input_args=argv)
    return distributed_utils.call_main(convert_namespace_to_omegaconf(args), train.main)


def _generate(argv):
    from fairseq import options
    from fairseq_cli import generate

    args = options.parse_args_and_arch(options.get_generation_parser(), input_args=argv)
    return generate.main(args)


def _eval_lm(argv):
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq_cli import eval_lm

    args = options.parse_args_and_arch(options.get_eval_lm_parser(), input_args=argv)
    return eval_lm.main(convert_namespace_to_omegaconf(args))


_RUNNERS = {
    "fairseq-preprocess": _preprocess,
    "fairseq-train": _train,
    "fairseq-generate": _generate,
    "fairseq-eval-lm": _eval_lm,
}


def configure_logging():
    """fairseq's own console format, on stdout, as its command-line tools set it up."""
    logging.basicConfig(
        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        level=os.environ.get("LOGLEVEL", "INFO").upper(),
        stream=sys.stdout,
    )
