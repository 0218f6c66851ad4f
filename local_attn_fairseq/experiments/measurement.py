"""Time, peak memory and operation counts of one call, forward only or forward + backward, on
CPU or GPU.

Shared by the benchmarks: every one measures the implementations it compares the same way.
"""

import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


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
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        one_call(fn, inputs, backward)
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        one_call(fn, inputs, backward)
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
