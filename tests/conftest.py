import contextlib
import io
import logging
import os
import runpy
import subprocess
import sys
import traceback
from importlib.metadata import entry_points

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_DIR = os.path.join(REPO, "local_attn_fairseq")
BIN = os.path.dirname(sys.executable)

sys.path.insert(0, REPO)
import local_attn_fairseq  # noqa: E402,F401  (shims + registrations, as --user-dir does)
from local_attn_fairseq.experiments.training_progress import LOG_FORMAT  # noqa: E402

from . import fairseq_config_composition  # noqa: E402

# fairseq's tools run here hundreds of times: their config composed once per choice of groups
fairseq_config_composition.install()

# One worker per core (pytest.ini): torch's threads beyond a worker's share of the cores only
# wait for each other (measured on 2 cores: the same tests took 35% longer and 70% more CPU).
# Each worker, and every process it starts, gets its share; tests of the kernels' parallel
# paths ask for more threads themselves (PARALLEL_THREADS).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
PARALLEL_THREADS = max(2, torch.get_num_threads())
if WORKERS > 1:
    THREAD_SHARE = max(1, (os.cpu_count() or 1) // WORKERS)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(THREAD_SHARE)
    torch.set_num_threads(THREAD_SHARE)


def fairseq_cli(tool, *args, cwd=None, check=True, stdin=None, separate_process=False):
    """Run a console script of this environment, the way a user types it.

    fairseq's tools and the plugin's own (``local-attn-analyze``, ``local-attn-recipe``) run
    their entry point (the function the installed script calls) in this process, sparing each
    call a Python start and the imports of torch and fairseq (about 4 s); what they print,
    their log and their exit status come back as from a separate process. ``separate_process``
    (and every other tool) runs the installed script itself.
    """
    args = [str(a) for a in args]
    cmd = [os.path.join(BIN, tool), *args]
    if tool in IN_PROCESS_ENTRY_POINTS and not separate_process:
        proc = _run_entry_point(tool, args, cwd, stdin)
    else:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, input=stdin)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


IN_PROCESS_ENTRY_POINTS = {
    e.name: e for e in entry_points(group="console_scripts")
    if e.value.startswith(("fairseq_cli.", "local_attn_fairseq."))
}  # fmt: skip


def forget_previous_best():
    """fairseq keeps the best validation score of a run on a function attribute: a second run in
    one process would compare against the first run's and might write no checkpoint_best.pt."""
    from fairseq import checkpoint_utils

    if hasattr(checkpoint_utils.save_checkpoint, "best"):
        del checkpoint_utils.save_checkpoint.best


def _run_entry_point(tool, args, cwd, stdin):
    main = IN_PROCESS_ENTRY_POINTS[tool].load()
    forget_previous_best()
    # what the installed script does: its exit status is what main returns
    return _run_in_process(tool, args, lambda: sys.exit(main()), cwd, stdin)


def run_script(script, *args, cwd=None, env=None, separate_process=False):
    """``python SCRIPT ARGS`` for a script of the repository (a path relative to it), as a user
    types it: in this process (run as ``__main__``), sparing a Python start and a fairseq
    import; what it prints and its exit status come back as from a separate process.
    ``separate_process`` starts the installed Python on it instead."""
    args = [str(a) for a in args]
    path = os.path.join(REPO, script)
    if separate_process:
        return subprocess.run(
            [sys.executable, path, *args], cwd=cwd, capture_output=True, text=True,
            env=None if env is None else dict(os.environ, **env),
        )  # fmt: skip
    run = lambda: runpy.run_path(path, run_name="__main__")  # noqa: E731
    return _run_in_process(path, args, run, cwd, env=env)


def _run_in_process(program, args, run, cwd, stdin=None, env=None):
    """``run()`` with sys.argv = [program, *args]: its output, log records, exit status (an
    exception's traceback on stderr, status 1), the process state restored afterwards."""
    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(out)
    # fairseq's tools log to stdout (fairseq_cli's logging.basicConfig): their records go there
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    saved = sys.argv, sys.stdin, os.getcwd(), root.handlers[:], root.level, dict(os.environ)
    sys.argv = [program, *args]
    sys.stdin = io.StringIO(stdin or "")
    os.environ.update(env or {})
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    returncode = 0
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                run()
            except SystemExit as e:  # argparse errors (2), the tools' one-line errors (1)
                if isinstance(e.code, str):
                    print(e.code, file=err)
                returncode = e.code if isinstance(e.code, int) else int(e.code is not None)
            except Exception:
                traceback.print_exc(file=err)
                returncode = 1
    finally:
        sys.argv, sys.stdin = saved[0], saved[1]
        os.chdir(saved[2])
        root.handlers[:] = saved[3]
        root.setLevel(saved[4])
        os.environ.clear()
        os.environ.update(saved[5])
    return subprocess.CompletedProcess(
        [program, *args], returncode, stdout=out.getvalue(), stderr=err.getvalue()
    )


def pytest_collection_modifyitems(config, items):
    """The files holding end-to-end runs (marked slow) first. Each file runs on one worker
    (pytest.ini: --dist loadfile), so its module fixtures are built once; the longest files
    start while there is other work to balance them, instead of one worker running the last
    demo while the others wait."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: file order kept


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models and shapes on a shared CPU: a second intra-op thread only waits, and more
    threads than cores cost ten times the time. For a module: pytestmark = usefixtures(...)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Small dims, but the 6 encoder layers and 8 heads the paper's presets are written for.
TINY_MODEL = (
    "--encoder-embed-dim 32 --encoder-ffn-embed-dim 64 --encoder-layers 6 "
    "--encoder-attention-heads 8 --decoder-embed-dim 32 --decoder-ffn-embed-dim 64 "
    "--decoder-layers 2 --decoder-attention-heads 8 --share-all-embeddings"
).split()
TRAIN = (
    "--optimizer adam --lr 1e-3 --max-tokens 1000 --num-workers 0 "
    "--criterion label_smoothed_cross_entropy --label-smoothing 0.1 --seed 1 "
    "--no-progress-bar --log-interval 1 --no-epoch-checkpoints"
).split()


def train_tiny(data, save_dir, *extra, max_update=2, arch="transformer_local"):
    """fairseq-train of a tiny plugin model on the tiny corpus, as a user would run it."""
    return fairseq_cli(
        "fairseq-train", data / "bin", "--user-dir", USER_DIR, "--arch", arch, *TINY_MODEL,
        *TRAIN, "--max-update", max_update, "--save-dir", save_dir, *extra,
    )  # fmt: skip


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A small real de-en corpus (Ding sentences, word-level) binarised by fairseq-preprocess."""
    root = tmp_path_factory.mktemp("ding_tiny")
    raw = root / "raw"
    prepared = run_script(os.path.join("scripts", "prepare_ding.py"), "--out-dir", raw)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
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
    train_tiny(tiny_data, save_dir, arch="transformer_local_tied")
    return save_dir / "checkpoint_last.pt"


def snapshot(folder):
    """{relative path: bytes} of every file under `folder`."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, folder)] = f.read()
    return files


def kill_sentencepiece(monkeypatch):
    """sentencepiece's training, from now on in this test, writes half a model where it was told
    to write and is then killed (a KeyboardInterrupt, as from Ctrl-C)."""
    import sentencepiece as spm

    def killed(model_prefix, **_):
        with open(model_prefix + ".model", "wb") as f:
            f.write(b"half a mod")
        raise KeyboardInterrupt

    monkeypatch.setattr(spm.SentencePieceTrainer, "train", killed)
