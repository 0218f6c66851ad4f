"""Every command of the README and of the docs' index exists, with every option it names.

The shell blocks of README.md and docs/README.md are read as a reader types them: continuation
lines joined, comments dropped, the variables earlier lines set expanded. Each command is then
checked in this process, without training or downloading anything:

* ``make TARGET [VAR="..."]``: the Makefile has the target, and the options in VAR are accepted
  by the script the target's recipe passes VAR to;
* ``fairseq-*``: fairseq's own parser for that tool, extended as the tool extends it (by
  ``--user-dir``, ``--arch``, ``--task``, ``--criterion``, ...), accepts every option, and a
  ``--locality-config`` value is a preset, file or mapping the plugin can read;
* the plugin's console scripts (setup.py), ``python FILE.py`` and ``python -m MODULE``: the
  argparse parser the command builds accepts the arguments;
* ``bash FILE`` and ``source FILE``: the file is there.

Options must be written out in full: argparse would accept a prefix of an option, which a later
option could make ambiguous. A command of any other kind is reported, so a new kind of command
in the README needs a check here before the test passes.
"""

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import io
import os
import re
import runpy
import shlex
import sys
import warnings
from unittest import mock

import pytest

from local_attn_fairseq.experiments import demo
from local_attn_fairseq.locality.spec import LocalitySpecError, load_spec_config

from .conftest import REPO

DOCUMENTS = ("README.md", "docs/README.md")
README_MAX_CHARACTERS = 12_000
FIRST_SCREEN_LINES = 50
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\]\(([^)\s]+)\)")
ASSIGNMENT = re.compile(r"^([A-Za-z_]\w*)=(.*)$", re.DOTALL)
SHELL_OPERATORS = {"&&", "||", "|", ";", "&", ">", ">>", "<"}
FAIRSEQ_PARSERS = {
    "fairseq-train": "get_training_parser",
    "fairseq-generate": "get_generation_parser",
    "fairseq-interactive": "get_interactive_generation_parser",
    "fairseq-validate": "get_validation_parser",
    "fairseq-eval-lm": "get_eval_lm_parser",
}
# Where a variable given to a command in front of it (NAME=value command) may be read.
SOURCES_READING_ENVIRONMENT = (
    "Makefile", "setup.py", "scripts", "local_attn_fairseq", "benchmarks",
)  # fmt: skip


class CommandError(Exception):
    """A command of the documentation that would not run as written."""


def read(path):
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return f.read()


# ---- reading the documents ---------------------------------------------------------------


def shell_blocks(text):
    """(line number of its first line, text) of every shell code block; a console block keeps
    only its ``$ `` command lines (and their continuations), other lines left blank."""
    for match in FENCE.finditer(text):
        if match.group(1) not in SHELL_LANGUAGES:
            continue
        body = match.group(2)
        if match.group(1) == "console":
            kept, continued = [], False
            for line in body.split("\n"):
                if line.startswith("$ ") or continued:
                    kept.append(line[2:] if line.startswith("$ ") and not continued else line)
                    continued = line.endswith("\\")
                else:
                    kept.append("")
            body = "\n".join(kept)
        yield text.count("\n", 0, match.start(2)) + 1, body


def opens_an_array(text):
    return re.match(r"^\s*[A-Za-z_]\w*=\(", text) is not None and text.count("(") > text.count(")")


def logical_lines(first_line, body):
    """(line number, text) of each command: continuation lines and multi-line arrays joined,
    blank and comment-only lines dropped."""
    lines = body.split("\n")
    i = 0
    while i < len(lines):
        number, text = first_line + i, lines[i]
        while (text.endswith("\\") or opens_an_array(text)) and i + 1 < len(lines):
            i += 1
            text = text[:-1] + lines[i] if text.endswith("\\") else text + "\n" + lines[i]
        i += 1
        if text.strip() and not text.strip().startswith("#"):
            yield number, text


def commands_of(path):
    text = read(path)
    for first_line, body in shell_blocks(text):
        yield from logical_lines(first_line, body)


# ---- running a command's argument parsing in this process ---------------------------------


class _ParserBuilt(Exception):
    def __init__(self, parser):
        super().__init__()
        self.parser = parser


def parser_built_by(run, argv0):
    """The argparse parser that ``run()`` builds and would parse its command line with."""

    def stop(parser, *args, **kwargs):
        raise _ParserBuilt(parser)

    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", stop),
        mock.patch.object(argparse.ArgumentParser, "parse_known_args", stop),
        mock.patch.object(sys, "argv", [argv0]),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: module already imported
        try:
            run()
        except _ParserBuilt as built:
            return built.parser
    raise CommandError(f"{argv0} parses no command line with argparse")


def quietly(parse, command):
    """``parse()``, an argparse error turned into a CommandError with argparse's message."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return parse()
        except SystemExit as exit:
            if exit.code:
                message = err.getvalue().strip().splitlines() or [f"exit status {exit.code}"]
                raise CommandError(f"{command}: {message[-1]}") from None
    return None


def option_strings(parser, argv):
    """The option names ``parser`` knows, with those of the subcommand ``argv`` selects."""
    known = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = next((a for a in argv if a in action.choices), None)
            if chosen is not None:
                known |= option_strings(action.choices[chosen], argv[argv.index(chosen) + 1 :])
    return known


def check_option_names(parser, argv, command):
    """Every option is written out in full (argparse itself would take a prefix)."""
    known = option_strings(parser, argv)
    for token in argv:
        if token == "--":
            break
        name = token.split("=", 1)[0]
        if token.startswith("-") and " " not in token and not is_number(token):
            if name not in known:
                raise CommandError(f"{command}: {name} is not an option of it")


def is_number(token):
    try:
        float(token)
    except ValueError:
        return False
    return True


def check_arguments(parser, argv, command):
    args = quietly(lambda: parser.parse_args(argv), command)
    check_option_names(parser, argv, command)
    return args


# ---- the commands ------------------------------------------------------------------------


def makefile_recipes():
    """target -> its recipe lines."""
    recipes, target = {}, None
    for line in read("Makefile").splitlines():
        rule = re.match(r"^([\w.-]+)\s*:(?!=)", line)
        if rule:
            target = rule.group(1)
            recipes[target] = []
        elif line.startswith("\t") and target is not None:
            recipes[target].append(line.strip())
        elif line.strip():
            target = None
    return recipes


def console_scripts():
    """name -> "module:function" of the plugin's console scripts, as setup.py declares them."""
    return dict(re.findall(r'"([\w-]+) = ([\w.]+:\w+)"', read("setup.py")))


def python_script_parser(path):
    if not path.endswith(".py") or not os.path.isfile(os.path.join(REPO, path)):
        raise CommandError(f"{path}: no such Python file in the repository")
    script = os.path.join(REPO, path)
    return parser_built_by(lambda: runpy.run_path(script, run_name="__main__"), path)


def python_module_parser(module):
    try:
        found = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        found = None
    if found is None:
        raise CommandError(f"python -m {module}: no such module")
    run = lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)  # noqa: E731
    return parser_built_by(run, module)


def check_make(argv, command):
    recipes = makefile_recipes()
    targets = [a for a in argv if "=" not in a]
    variables = [a.split("=", 1) for a in argv if "=" in a]
    for target in targets:
        if target.startswith("-") or target not in recipes:
            raise CommandError(f"{command}: the Makefile has no target {target!r}")
    for name, value in variables:
        for target in targets or ["<default>"]:
            lines = [line for line in recipes.get(target, []) if f"$({name})" in line]
            if not lines:
                raise CommandError(f"{command}: make {target} does not use {name}")
            scripts = [t for t in lines[0].split() if t.endswith(".py")]
            if not scripts:
                raise CommandError(f"{command}: no check for {name} in '{lines[0]}'")
            check_arguments(python_script_parser(scripts[0]), shlex.split(value), command)


def check_python(argv, command):
    if argv[:1] == ["-m"] and len(argv) > 1:
        parser = python_module_parser(argv[1])
        return check_arguments(parser, argv[2:], command)
    if not argv:
        raise CommandError(f"{command}: no script")
    return check_arguments(python_script_parser(argv[0]), argv[1:], command)


def check_fairseq(tool, argv, command):
    from fairseq import options

    installed = {e.name for e in importlib.metadata.entry_points(group="console_scripts")}
    if tool not in installed:
        raise CommandError(f"{command}: {tool} is not a console script of the environment")
    if tool == "fairseq-preprocess":
        with mock.patch.object(sys, "argv", [tool, *argv]):
            return check_arguments(options.get_preprocessing_parser(), argv, command)
    if tool not in FAIRSEQ_PARSERS:
        raise CommandError(f"{command}: no check for {tool}")
    with mock.patch.object(sys, "argv", [tool, *argv]):
        parser = quietly(getattr(options, FAIRSEQ_PARSERS[tool]), command)

        def parse():
            try:
                return options.parse_args_and_arch(parser, input_args=argv, parse_known=True)
            except RuntimeError:  # fairseq's way of saying that no model was chosen
                raise CommandError(f"{command}: {tool} needs --arch") from None

        args, unknown = quietly(parse, command)
    if unknown:
        raise CommandError(f"{command}: {tool} does not take {' '.join(unknown)}")
    check_option_names(parser, argv, command)
    if getattr(args, "locality_config", None):
        try:
            load_spec_config(args.locality_config)
        except LocalitySpecError as error:
            raise CommandError(f"{command}: {error}") from None
    return args


def check_console_script(name, target, argv, command):
    module, function = target.split(":")
    main = getattr(importlib.import_module(module), function)
    args = check_arguments(parser_built_by(main, name), argv, command)
    recipe = getattr(args, "recipe", None)
    if name == "local-attn-recipe" and recipe is not None:
        if not os.path.isfile(os.path.join(REPO, "configs", "recipes", f"{recipe}.yaml")):
            raise CommandError(f"{command}: no recipe {recipe!r} in configs/recipes/")


def check_file_argument(tool, argv, command):
    if len(argv) != 1:
        raise CommandError(f"{command}: {tool} takes one file here, got {argv}")
    path = argv[0]
    if os.path.isfile(os.path.join(REPO, path)):
        return
    # the virtual environment scripts/setup_env.sh makes: this test runs inside one
    venv = ".venv/"
    made_by_setup = "$ROOT/.venv" in read("scripts/setup_env.sh")
    if path.startswith(venv) and made_by_setup:
        if os.path.isfile(os.path.join(sys.prefix, path[len(venv) :])):
            return
    raise CommandError(f"{command}: no file {path}")


def environment_variable_is_read(name):
    for place in SOURCES_READING_ENVIRONMENT:
        root = os.path.join(REPO, place)
        files = [root] if os.path.isfile(root) else [
            os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
            if f.endswith((".py", ".sh"))
        ]  # fmt: skip
        for path in files:
            with open(path, encoding="utf-8", errors="replace") as f:
                if name in f.read():
                    return True
    return False


class Shell:
    """The variables a document's blocks set, in order, and the check of each line."""

    def __init__(self):
        self.variables = {}  # name -> list of words (one word for a scalar)

    def value(self, name, line):
        if name not in self.variables:
            raise CommandError(f"{line}: ${name} is not set by the lines before it")
        return self.variables[name]

    def output_of(self, command, line):
        """What ``$(command)`` prints: only ``python -m MODULE`` is evaluated (in-process)."""
        argv = shlex.split(command)
        if argv[:2] not in (["python", "-m"], ["python3", "-m"]) or len(argv) < 3:
            raise CommandError(f"{line}: no way to evaluate $({command})")
        self.check(command)
        out = io.StringIO()
        run = lambda: runpy.run_module(argv[2], run_name="__main__", alter_sys=True)  # noqa
        with (
            contextlib.redirect_stdout(out),
            mock.patch.object(sys, "argv", [argv[2], *argv[3:]]),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore", RuntimeWarning)
            run()
        return out.getvalue().strip()

    def expand(self, token, line):
        """One word, or the words of an array (a token that is exactly ``${NAME[@]}``)."""
        array = re.fullmatch(r"\$\{(\w+)\[@\]\}", token)
        if array:
            return list(self.value(array.group(1), line))
        if "$(" in token:
            inner = re.fullmatch(r"(.*?)\$\(([^()]*)\)(.*)", token)
            if inner is None:
                raise CommandError(f"{line}: quote the command substitution in {token!r}")
            token = inner.group(1) + self.output_of(inner.group(2), line) + inner.group(3)
        return [
            re.sub(
                r"\$\{(\w+)\}|\$(\w+)",
                lambda m: " ".join(self.value(m.group(1) or m.group(2), line)),
                token,
            )
        ]

    def check(self, line):
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError as error:
            raise CommandError(f"{line}: {error}") from None
        if not tokens:
            return
        if any(t in SHELL_OPERATORS or t.endswith(";") for t in tokens):
            raise CommandError(f"{line}: one command a line, without pipes or redirections")
        assignment = ASSIGNMENT.match(tokens[0])
        if assignment and assignment.group(2).startswith("("):  # NAME=(words ...)
            if not tokens[-1].endswith(")"):
                raise CommandError(f"{line}: an array that is not closed")
            words = [assignment.group(2)[1:], *tokens[1:]]
            words[-1] = words[-1][:-1]
            self.variables[assignment.group(1)] = [
                w for word in words if word for w in self.expand(word, line)
            ]
            return
        if assignment and len(tokens) == 1:  # NAME=value
            self.variables[assignment.group(1)] = self.expand(assignment.group(2), line)
            return
        while tokens and ASSIGNMENT.match(tokens[0]):  # NAME=value command: read by the command
            name = ASSIGNMENT.match(tokens.pop(0)).group(1)
            if not environment_variable_is_read(name):
                raise CommandError(f"{line}: nothing in the repository reads {name}")
        argv = [w for token in tokens for w in self.expand(token, line)]
        self.run_check(argv[0], argv[1:], line)

    def run_check(self, tool, argv, line):
        scripts = console_scripts()
        if tool == "make":
            check_make(argv, line)
        elif tool in ("python", "python3"):
            check_python(argv, line)
        elif tool.startswith("fairseq-"):
            check_fairseq(tool, argv, line)
        elif tool in scripts:
            check_console_script(tool, scripts[tool], argv, line)
        elif tool in ("bash", "source", "."):
            check_file_argument(tool, argv, line)
        else:
            raise CommandError(f"{line}: no check for the command {tool!r}")


# ---- the tests ---------------------------------------------------------------------------


@pytest.fixture
def in_the_repository(monkeypatch):
    """As the README's commands run: from the repository root."""
    monkeypatch.chdir(REPO)


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_command_runs_as_written(document, in_the_repository):
    shell, failures, checked = Shell(), [], 0
    for number, line in commands_of(document):
        try:
            shell.check(line)
            checked += 1
        except CommandError as error:
            failures.append(f"{document}:{number}: {error}")
    assert not failures, "\n".join(failures)
    if document == "README.md":
        assert checked >= 8, "the README's shell blocks hold fewer commands than it shows"


@pytest.mark.parametrize(
    "line, complaint",
    [
        ("fairseq-train data --user-dir local_attn_fairseq --arch transformer_local_tied "
         "--no-such-option 1", "--no-such-option"),
        ("fairseq-train data --user-dir local_attn_fairseq --arch transformer_local_tied "
         "--locality-conf 8loc-first3", "does not take --locality-conf"),
        ("fairseq-train data --user-dir local_attn_fairseq --arch no_such_arch", "no_such_arch"),
        ("fairseq-train data --user-dir local_attn_fairseq --arch transformer_local "
         "--locality-config 8loc-first4", "8loc-first4"),
        ("fairseq-generate data --user-dir local_attn_fairseq --path x.pt --beams 5", "--beams"),
        ("fairseq-train data --user-dir local_attn_fairseq --lr 1e-3", "needs --arch"),
        ("fairseq-fly data", "fairseq-fly is not a console script"),
        ("fairseq-generate $UNSET --path x.pt", "$UNSET is not set"),
        ("make no-such-target", "no target 'no-such-target'"),
        ('make demo DEMO_ARGS="--corpus wmt14-en-de"', "invalid choice: 'wmt14-en-de'"),
        ('make demo DEMO_ARGS="--epoch 3"', "--epoch is not an option"),
        ('make demo BENCH_ARGS="--rounds 2"', "make demo does not use BENCH_ARGS"),
        ("NO_SUCH_SETTING=1 make demo", "nothing in the repository reads NO_SUCH_SETTING"),
        ("local-attn-analyze heads --path x.pt --no-such-flag", "--no-such-flag"),
        ("local-attn-analyze no-such-analysis --path x.pt", "invalid choice: 'no-such-analysis'"),
        ("local-attn-recipe no_such_recipe --list-rows", "no recipe 'no_such_recipe'"),
        ("python scripts/no_such_script.py", "no such Python file"),
        ("python -m no_such_module", "no such module"),
        ("python scripts/demo.py --corpus bible-en-es --no-such-flag", "--no-such-flag"),
        ("bash scripts/no_such_setup.sh", "no file scripts/no_such_setup.sh"),
        ("make demo | tee log", "one command a line"),
        ("rm -rf demo_runs", "no check for the command 'rm'"),
    ],
)
def test_a_wrong_command_or_option_is_reported(line, complaint, in_the_repository):
    with pytest.raises(CommandError, match=re.escape(complaint)):
        Shell().check(line)


def test_variables_set_by_earlier_lines_are_expanded_as_bash_would():
    shell = Shell()
    shell.check('PLUGIN="$(python -m local_attn_fairseq)"')
    shell.check('TRAIN=(--lr 5e-4 --adam-betas "(0.9, 0.98)"\n    --max-tokens 4096)')
    assert os.path.samefile(shell.variables["PLUGIN"][0], os.path.join(REPO, "local_attn_fairseq"))
    assert shell.variables["TRAIN"] == ["--lr", "5e-4", "--adam-betas", "(0.9, 0.98)",
                                        "--max-tokens", "4096"]  # fmt: skip
    assert shell.expand("${TRAIN[@]}", "") == shell.variables["TRAIN"]
    assert shell.expand("$PLUGIN/models", "") == [shell.variables["PLUGIN"][0] + "/models"]
    block = (
        "make demo   # a comment\nTRAIN=(--a\n  --b)\nfairseq-train x \\\n  --lr 1\n"
        "# only a comment\n"
    )
    assert list(logical_lines(10, block)) == [
        (10, "make demo   # a comment"),
        (11, "TRAIN=(--a\n  --b)"),
        (13, "fairseq-train x   --lr 1"),
    ]


def test_console_blocks_contribute_their_command_lines_only():
    text = "```console\n$ make demo \\\n  DEMO_ARGS=x\nsome output\n$ make test\n```\n"
    [(first, body)] = shell_blocks(text)
    assert list(logical_lines(first, body)) == [(2, "make demo   DEMO_ARGS=x"), (5, "make test")]


def github_anchors(path):
    """The anchors GitHub gives the headings of a markdown file (outside code blocks)."""
    text = FENCE.sub("", read(path))
    anchors, seen = set(), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


@pytest.mark.parametrize("document", DOCUMENTS)
def test_links_to_pages_of_the_repository_point_at_files_and_headings_that_exist(document):
    broken = []
    for target in LINK.findall(FENCE.sub("", read(document))):
        if re.match(r"^[a-z]+:", target):
            continue  # a web address
        path, _, anchor = target.partition("#")
        resolved = document  # a heading of the document itself
        if path:
            resolved = os.path.normpath(os.path.join(os.path.dirname(document), path))
        if not os.path.exists(os.path.join(REPO, resolved)):
            broken.append(f"{target}: no file {resolved}")
        elif anchor and resolved.endswith(".md") and anchor not in github_anchors(resolved):
            broken.append(f"{target}: {resolved} has no heading #{anchor}")
    assert not broken, f"{document}: " + "; ".join(broken)


def test_the_docs_index_lists_every_page():
    index = os.path.join("docs", "README.md")
    linked = {
        os.path.normpath(os.path.join("docs", target.partition("#")[0]))
        for target in LINK.findall(read(index))
    }
    pages = {
        os.path.relpath(os.path.join(folder, name), REPO)
        for folder, _, names in os.walk(os.path.join(REPO, "docs"))
        for name in names
        if name.endswith(".md")
    } - {index}
    assert pages, "no pages found under docs/"
    assert not pages - linked, f"docs/README.md does not list {sorted(pages - linked)}"


def test_the_readme_is_a_front_door_with_the_two_commands_and_the_demo_table_first():
    text = read("README.md")
    assert len(text) <= README_MAX_CHARACTERS, f"README.md has {len(text)} characters"
    first_screen = text.splitlines()[:FIRST_SCREEN_LINES]
    _, first_block = next(shell_blocks(text))
    commands = [shlex.split(line, comments=True) for _, line in logical_lines(0, first_block)]
    assert commands == [["make", "demo"], ["make", "test"]]
    # the table make demo prints, in the demo's own format, and its default corpus's title
    header = demo.results_table([]).splitlines()[0]
    assert header in first_screen, f"no demo table in the first {FIRST_SCREEN_LINES} lines"
    corpus_name = demo.CORPORA[demo.DEFAULT_CORPUS][3]
    assert any(line.startswith(f"{corpus_name} test (") for line in first_screen)
