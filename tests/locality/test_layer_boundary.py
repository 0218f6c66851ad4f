"""``locality/`` is the mechanisms and the spec, below the command line and fairseq: its modules
import one another and the operators of ``ops/``, never fairseq, the models or the command-line
readers (``cli_types`` wraps ``locality.layer_selection`` for argparse, not the other way)."""

import ast
import pathlib

import local_attn_fairseq
from local_attn_fairseq import cli_types
from local_attn_fairseq.locality import layer_selection

LOCALITY = pathlib.Path(local_attn_fairseq.__file__).parent / "locality"
PACKAGE = "local_attn_fairseq"
LAYERS_BELOW = ("locality", "ops")  # what locality/ may import from the package


def imported_modules(path):
    """(module as written, relative level) of every import in a file, nested ones included."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, 0) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield node.module or "", node.level


def package_part(module, level):
    """The top folder or module of the package an import reaches, or None outside the package."""
    if level == 1:
        return "locality"
    if level == 2:
        return module.split(".")[0]
    if module == PACKAGE or module.startswith(PACKAGE + "."):
        return module.split(".")[1] if "." in module else ""
    return None


def test_locality_imports_nothing_above_it():
    files = sorted(LOCALITY.glob("*.py"))
    assert any(f.name == "spec.py" for f in files)
    wrong = [
        f"{path.name}: {'.' * level}{module}"
        for path in files
        for module, level in imported_modules(path)
        if module.split(".")[0] == "fairseq"
        or package_part(module, level) not in (None, *LAYERS_BELOW)
    ]
    assert wrong == []


def test_the_command_line_reads_selectors_with_the_locality_reader():
    assert cli_types.layer_selection is layer_selection.layer_selection
    assert layer_selection.layer_selection("0-1,3", 4) == [0, 1, 3]
