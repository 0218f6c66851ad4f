"""Time, peak memory and operation counts of one call, forward only or forward + backward, on
CPU or GPU, and the useful work and the least memory traffic of one banded attention call; a
folder of made-up dictionaries, from which the benchmarks build fairseq's models without data.

Shared by the benchmarks: every one measures the implementations it compares the same way.
"""

import argparse
import errno
import gc
import os
import tempfile
import time
from typing import Callable, Dict, Iterable, List, Mapping, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..file_safety import atomic_write_text, exit_on_os_error


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_call(fn, inputs, backward):
    """``fn(*inputs)``, under no_grad, or followed by a backward pass of ones whose input
    gradients are then dropped."""
    if not backward:
        with torch.no_grad():
            fn(*inputs)
        return
    out = fn(*inputs)
    out.backward(torch.ones_like(out))
    for t in inputs:
        t.grad = None


def timed(fn, inputs, backward):
    """Wall-clock seconds of one call, the device's queued work included."""
    device = inputs[0].device if inputs else torch.device("cpu")
    synchronize(device)
    start = time.perf_counter()
    one_call(fn, inputs, backward)
    synchronize(device)
    return time.perf_counter() - start


def peak_bytes(fn, inputs, backward):
    """Peak of torch's allocations during one call, above what was live before it."""
    device = inputs[0].device
    if device.type == "cuda":
        gc.collect()  # as cpu_allocation_peak does: no earlier garbage freed inside the call
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        one_call(fn, inputs, backward)
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    return cpu_allocation_peak(lambda: one_call(fn, inputs, backward))


def cpu_allocation_peak(call: Callable[[], object]) -> int:
    """Peak of torch's CPU allocations during ``call()``, above what was live before it: the
    running sum of the allocation events (+bytes, -bytes on free) of torch's profiler.

    Garbage is collected first: a tensor held only by a reference cycle, allocated in an earlier
    measurement (a model built there), would be freed inside this one whenever Python's
    collector happens to run, a negative event that lowers the peak by its size. (The profiler
    reports no frees of blocks allocated while no profiler recorded memory.)"""
    gc.collect()
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        call()
    # The raw allocation events (+bytes, -bytes on free), in time order, CPU only.
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    live = peak = 0
    for _, change in events:
        live += change
        peak = max(peak, live)
    return peak


def band_flops(batch, heads, length, width, dim, backward):
    """The useful FLOPs of banded attention, alike for every route: 4 * B * H * T * w * D forward
    (q k^T and p v, 2 FLOPs per multiply-add) and 3x that with backward (backward = 2x forward).

    w is clipped to T: a band wider than the sequence holds no more keys than it.
    """
    forward = 4 * batch * heads * length * min(width, length) * dim
    return forward * (3 if backward else 1)


def attention_traffic_bytes(batch, heads, length, dim, element_size, backward):
    """The fewest bytes one attention call must move through device memory, whatever its route.

    Forward: read q, k, v and write out (4 * B * H * T * D elements), write the float32 row
    log-sum-exp (B * H * T * 4 bytes) that the backward pass needs. Backward adds: read q, k, v,
    out, grad_out and the log-sum-exp, write dq, dk, dv (8 * B * H * T * D elements and the
    log-sum-exp again). Over a call's time this is a lower bound of the bandwidth it used: a
    route that also moves masks, logits or partial results moves more.
    """
    elements = batch * heads * length * dim
    lse_bytes = batch * heads * length * 4
    forward = 4 * elements * element_size + lse_bytes
    if not backward:
        return forward
    return forward + 8 * elements * element_size + lse_bytes


class ForwardBackward:
    """One training call of ``forward()``, prepared once: forward, backward of a fixed output
    gradient, then the gradients left on ``leaves`` dropped, as ``zero_grad(set_to_none=True)``
    does between steps, so that every call's backward assigns gradients instead of adding to
    those of the call before."""

    def __init__(self, forward: Callable[[], torch.Tensor], leaves: Iterable[torch.Tensor]):
        self.forward = forward
        self.leaves = tuple(leaves)
        self.grad_output = torch.ones_like(forward())

    def __call__(self) -> None:
        self.forward().backward(self.grad_output)
        for leaf in self.leaves:
            leaf.grad = None


def host_seconds_per_call(call: Callable[[], None], calls: int, device) -> float:
    """The host's time for ``calls`` calls, per call. On a GPU, the wall time of issuing them:
    the device is synchronised before the loop and after the clock stops, never inside, so the
    kernels queue up while the host goes on (the host's cost, as long as the device keeps up).
    On the CPU, where the call is all host work, the CPU time the process spent on them: on a
    shared machine, time spent waiting for a core is not the call's."""
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    synchronize(device)
    start = clock()
    for _ in range(calls):
        call()
    elapsed = clock() - start
    synchronize(device)
    return elapsed / calls


def device_seconds_per_call(call: Callable[[], None], calls: int) -> float:
    """The GPU's busy time per call: the durations of the kernels, copies and fills that
    torch.profiler saw on the device, summed (idle gaps between them, where the GPU waits for
    the host, left out)."""
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    busy_ns = sum(
        e.duration_ns()
        for e in prof.profiler.kineto_results.events()
        if e.device_type() == torch.autograd.DeviceType.CUDA
    )
    return busy_ns * 1e-9 / calls


def alternating_rounds(
    measures: Mapping[str, Callable[[], float]], rounds: int
) -> Dict[str, List[float]]:
    """Every measure once a round, in reversed order every other round, so that the drifts of a
    shared, noisy machine fall on all of them alike; {name: one value per round}."""
    names = list(measures)
    values: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            values[name].append(measures[name]())
    return values


class OperationCounter(TorchDispatchMode):
    """Counts the aten operations that run under it, views left out.

    On a GPU each of them is at least one kernel launch prepared by the host, so where a step is
    bound by the host (small batches, short sentences) their number, not the arithmetic, sets
    its time; the count is the same on the CPU, where it can be measured without a GPU.
    """

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        # dtype arithmetic (promote_types) reaches the dispatcher too but touches no tensor
        touches_tensors = any(
            isinstance(x, torch.Tensor) for x in tree_leaves((args, kwargs, result))
        )
        if touches_tensors and not func.is_view:
            self.count += 1
        return result


def operations_per_call(call: Callable[[], None]) -> int:
    """The aten operations (views aside) that one ``call()`` runs."""
    with OperationCounter() as counter:
        call()
    return counter.count


class DictionaryFolder:
    """A temporary folder of fairseq dictionaries of made-up words, ``dict.<name>.txt`` for each
    name (``dict.txt`` for ""): all a task reads to build models by fairseq's own argument
    parsing, as fairseq-train builds them, without data."""

    def __init__(self, prefix: str, names: Sequence[str] = ("",), words: int = 16):
        self._folder = tempfile.TemporaryDirectory(prefix=prefix)
        self.path = self._folder.name
        for name in names:
            filename = f"dict.{name}.txt" if name else "dict.txt"
            with open(os.path.join(self.path, filename), "w", encoding="utf-8") as f:
                f.writelines(f"w{i} 1\n" for i in range(words))

    def close(self):
        self._folder.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# The benchmarks' output files. An existing file is replaced only with --overwrite, even one an
# earlier run of the same benchmark wrote: it holds measurements (another machine's, another
# GPU's) that a run here would not give back. Checked before measuring: a run can take hours.


def add_overwrite_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace existing output files (without it an existing file is refused)",
    )


def check_output_file(path: str, option: str, overwrite: bool = False) -> None:
    """End the program with one line naming `option` (status 1) where `path` is an existing
    file (unless `overwrite`), or its folder cannot be made or written in. (A folder, or a path
    under a regular file, is refused by the option's type, ``cli_types.output_file``.)"""
    with exit_on_os_error(option):
        if os.path.isfile(path) and not overwrite:
            raise FileExistsError(
                errno.EEXIST,
                "exists; choose another path, or pass --overwrite to replace it",
                path,
            )
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        if not os.access(folder, os.W_OK):
            raise PermissionError(errno.EACCES, "no permission to write in this folder", folder)


def write_output_file(path: str, option: str, text: str) -> None:
    """Write a checked output (`check_output_file`) atomically; a failure is one line."""
    with exit_on_os_error(option):
        atomic_write_text(path, text)
