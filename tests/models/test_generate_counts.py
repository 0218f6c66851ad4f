"""The README's fairseq-generate command scores every sentence of a test split.

fairseq drops a last batch whose size is not a multiple of ``--required-batch-size-multiple``
(default 8) at generation time too, so a 50-sentence test set would be scored on 48 sentences.
The test runs the README's own command (its options as written there, only the paths replaced).
"""

import os
import re
import shlex

import pytest

from ..conftest import REPO, USER_DIR, fairseq_cli

TEST_SENTENCES = 50  # not a multiple of 8


def readme_generate_command():
    """The first fairseq-generate command of the README, continuation lines joined."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    match = re.search(r"^fairseq-generate (?:.*\\\n)*.*$", text, re.MULTILINE)
    assert match, "the README has no fairseq-generate command"
    return shlex.split(match.group(0).replace("\\\n", " "))


def with_paths(argv, data, checkpoint):
    """The documented options with this test's data, checkpoint and plugin directory."""
    values = {"--path": checkpoint, "--user-dir": USER_DIR}
    out, i = [argv[0], str(data)], 2  # argv[1] is the README's data directory
    while i < len(argv):
        out.append(argv[i])
        if argv[i] in values:
            out.append(str(values[argv[i]]))
            i += 1
        i += 1
    return out[1:]


@pytest.fixture(scope="module")
def fifty_sentence_test_split(tiny_data, tmp_path_factory):
    """The tiny corpus's dictionaries with a test split of 50 Ding sentences."""
    root = tmp_path_factory.mktemp("test50")
    for lang in ("de", "en"):
        with open(tiny_data / "raw" / f"test.{lang}", encoding="utf-8") as f:
            lines = [next(f) for _ in range(TEST_SENTENCES)]
        (root / f"test.{lang}").write_text("".join(lines), encoding="utf-8")
    fairseq_cli(
        "fairseq-preprocess", "--source-lang", "de", "--target-lang", "en",
        "--testpref", root / "test", "--destdir", root / "bin",
        "--srcdict", tiny_data / "bin" / "dict.de.txt",
        "--tgtdict", tiny_data / "bin" / "dict.en.txt", "--workers", 1,
    )  # fmt: skip
    return root / "bin"


def translated(proc):
    hypotheses = [line for line in proc.stdout.splitlines() if line.startswith("H-")]
    reported = re.search(r"Translated ([\d,]+) sentences", proc.stdout + proc.stderr)
    return len(hypotheses), int(reported.group(1).replace(",", ""))


def test_readme_generate_command_translates_every_sentence(
    fifty_sentence_test_split, trained_checkpoint
):
    argv = with_paths(readme_generate_command(), fifty_sentence_test_split, trained_checkpoint)
    assert "--required-batch-size-multiple" in argv
    speed = ["--beam", "2", "--max-len-b", "5", "--num-workers", "0"]
    proc = fairseq_cli("fairseq-generate", *argv, *speed)
    assert translated(proc) == (TEST_SENTENCES, TEST_SENTENCES)
    assert "BLEU" in proc.stdout

    # fairseq's default drops the last two sentences: what the option is there for
    i = argv.index("--required-batch-size-multiple")
    default = argv[:i] + argv[i + 2 :]
    proc = fairseq_cli("fairseq-generate", *default, *speed)
    assert translated(proc) == (48, 48)
