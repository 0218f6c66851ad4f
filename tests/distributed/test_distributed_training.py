"""fairseq's data-parallel training (2 CPU processes, gloo) of a model with every mechanism.

Each rank records its replica before the first and after every update (record_ranks.py). After
training, the replicas must be identical although the ranks saw different sentences, and every
parameter (tied Wq/Wk owners, head gates, localness and window predictors, the AW heads' local
projections, relative positions) must have moved: a parameter that got no gradient would have
stopped fairseq's default DDP (find_unused_parameters=False) or stayed at its initial value.
"""

import os
import socket
import subprocess
import sys

import pytest
import torch

from ..conftest import TRAIN, USER_DIR
from ..models.test_combined_mechanisms import COMBINED_MODEL, COMBINED_OPTIONS, PARAMETER_KINDS

RECORDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "record_ranks.py")
WORLD_SIZE = 2
# the second forward is where DDP reports a parameter left without gradient
UPDATES = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def train_on_ranks(data, save_dir, record_dir, *extra):
    """Start one fairseq-train process per rank, as on a cluster without a launcher."""
    record_dir.mkdir()
    init = f"tcp://localhost:{free_port()}"
    # one thread per rank: the ranks share the machine's cores
    env = {**os.environ, "RECORD_RANKS_DIR": str(record_dir), "OMP_NUM_THREADS": "1"}
    procs = []
    for rank in range(WORLD_SIZE):
        cmd = [
            sys.executable, RECORDER, data / "bin", "--user-dir", USER_DIR, *COMBINED_MODEL,
            *TRAIN, *COMBINED_OPTIONS, "--max-update", UPDATES, "--save-dir", save_dir, "--cpu",
            "--distributed-world-size", WORLD_SIZE, "--distributed-backend", "gloo",
            "--distributed-no-spawn", "--distributed-init-method", init,
            "--distributed-rank", rank, "--disable-validation", "--no-save", *extra,
        ]  # fmt: skip
        log = open(record_dir / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen(list(map(str, cmd)), stdout=log, stderr=log, env=env), log))
    failed = []
    for rank, (proc, log) in enumerate(procs):
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "timeout"
        log.close()
        if code != 0:
            failed.append(
                f"rank {rank} ({code}):\n{(record_dir / f'rank{rank}.log').read_text()[-3000:]}"
            )
    assert not failed, "\n".join(failed)


def load_replicas(record_dir, update):
    return [torch.load(record_dir / f"rank{r}-update{update}.pt") for r in range(WORLD_SIZE)]


def assert_replicas_identical(replicas):
    first = replicas[0]["params"]
    for other in replicas[1:]:
        assert other["params"].keys() == first.keys()
        differing = [n for n, p in first.items() if not torch.equal(p, other["params"][n])]
        assert not differing, f"rank {other['rank']} diverged from rank 0 in {differing[:5]}"


def test_replica_comparison_detects_a_diverged_parameter():
    params = {"a.weight": torch.ones(2, 2), "a.head_gates.log_alpha": torch.full((4,), 3.0)}
    diverged = {**params, "a.head_gates.log_alpha": torch.tensor([3.0, 3.0, 3.0, 3.0001])}
    with pytest.raises(AssertionError, match="head_gates.log_alpha"):
        assert_replicas_identical([{"rank": 0, "params": params}, {"rank": 1, "params": diverged}])


@pytest.mark.parametrize("ddp_backend", ["pytorch_ddp", "legacy_ddp"])
def test_ranks_stay_identical_and_train_every_parameter(tiny_data, tmp_path, ddp_backend):
    record_dir = tmp_path / "ranks"
    train_on_ranks(tiny_data, tmp_path / "ckpt", record_dir, "--ddp-backend", ddp_backend)
    start, end = load_replicas(record_dir, 0), load_replicas(record_dir, UPDATES)
    assert_replicas_identical(start)
    assert_replicas_identical(end)
    for update in range(1, UPDATES + 1):
        first, second = load_replicas(record_dir, update)
        assert not set(first["sentence_ids"]) & set(second["sentence_ids"]), "ranks shared data"
    untrained = [n for n, p in start[0]["params"].items() if torch.equal(p, end[0]["params"][n])]
    assert not untrained, f"parameters without any update: {untrained}"
    names = list(end[0]["params"])
    for kind in PARAMETER_KINDS:
        assert any(kind in n for n in names), f"the model has no {kind} parameter"
