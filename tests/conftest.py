import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_DIR = os.path.join(REPO, "local_attn_fairseq")
BIN = os.path.dirname(sys.executable)

sys.path.insert(0, REPO)
import local_attn_fairseq  # noqa: E402,F401  (shims + registrations, as --user-dir does)


def fairseq_cli(tool, *args, cwd=None, check=True, stdin=None):
    """Run a fairseq console script of this environment, the way a user types it."""
    cmd = [os.path.join(BIN, tool), *map(str, args)]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, input=stdin)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A small real de-en corpus (Ding sentences, word-level) binarised by fairseq-preprocess."""
    root = tmp_path_factory.mktemp("ding_tiny")
    raw = root / "raw"
    subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "prepare_ding.py"), "--out-dir", str(raw)],
        check=True,
        capture_output=True,
    )
    sizes = {"train": 400, "valid": 40, "test": 40}
    small = root / "small"
    small.mkdir()
    for split, n in sizes.items():
        for lang in ("de", "en"):
            with open(raw / f"{split}.{lang}", encoding="utf-8") as f:
                lines = [next(f) for _ in range(n)]
            (small / f"{split}.{lang}").write_text("".join(lines), encoding="utf-8")
    fairseq_cli(
        "fairseq-preprocess",
        "--source-lang",
        "de",
        "--target-lang",
        "en",
        "--trainpref",
        small / "train",
        "--validpref",
        small / "valid",
        "--testpref",
        small / "test",
        "--destdir",
        root / "bin",
        "--joined-dictionary",
        "--workers",
        "1",
    )
    return root


@pytest.fixture(scope="session")
def trained_checkpoint(tiny_data, tmp_path_factory):
    """A checkpoint written by fairseq-train (two updates of a tiny transformer_local_tied)."""
    save_dir = tmp_path_factory.mktemp("ckpt_tied")
    fairseq_cli(
        "fairseq-train",
        tiny_data / "bin",
        "--user-dir",
        USER_DIR,
        "--arch",
        "transformer_local_tied_tiny",
        "--encoder-embed-dim",
        32,
        "--encoder-ffn-embed-dim",
        64,
        "--decoder-embed-dim",
        32,
        "--decoder-ffn-embed-dim",
        64,
        "--decoder-layers",
        1,
        "--optimizer",
        "adam",
        "--lr",
        "1e-3",
        "--max-tokens",
        1000,
        "--max-update",
        2,
        "--num-workers",
        0,
        "--no-progress-bar",
        "--save-dir",
        save_dir,
    )
    return save_dir / "checkpoint_last.pt"
