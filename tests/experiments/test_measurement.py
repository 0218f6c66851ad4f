"""The benchmarks' shared measurements."""

import gc

import torch

from local_attn_fairseq.experiments.measurement import (
    OperationCounter,
    attention_traffic_bytes,
    band_flops,
    cpu_allocation_peak,
)


def test_operation_counter_counts_what_runs_and_leaves_views_out():
    x = torch.randn(3, 4, requires_grad=True)
    with OperationCounter() as views:
        x.view(12).view(3, 4).t()[1:]
    assert views.count == 0
    with OperationCounter() as copy:
        x.t().reshape(12)  # a transposed tensor cannot be viewed flat: reshape copies it
    assert copy.count >= 1
    with OperationCounter() as counted:
        y = (x @ x.t()).relu().sum()  # mm, relu, sum
    assert counted.count == 3
    with OperationCounter() as with_backward:
        y.backward()
    assert with_backward.count > 0 and x.grad.shape == x.shape
    with OperationCounter() as dtypes_only:
        torch.promote_types(torch.float16, torch.float32)
    assert dtypes_only.count == 0


def test_attention_traffic_counts_inputs_outputs_and_the_log_sum_exp():
    # B=2, H=3, T=5, D=7: 210 elements per tensor, 30 float32 log-sum-exp values (120 bytes)
    fp16 = 2
    # forward: q, k, v read, out written, lse written
    assert attention_traffic_bytes(2, 3, 5, 7, fp16, backward=False) == 4 * 210 * 2 + 120
    # backward adds q, k, v, out, grad_out and lse read, dq, dk, dv written
    assert attention_traffic_bytes(2, 3, 5, 7, fp16, backward=True) == 12 * 210 * 2 + 2 * 120
    assert attention_traffic_bytes(1, 1, 1024, 64, 4, backward=False) == 4 * 65536 * 4 + 4096


def test_band_flops_count_the_band_clipped_to_the_sequence():
    assert band_flops(2, 3, 100, 9, 16, backward=False) == 4 * 2 * 3 * 100 * 9 * 16
    assert band_flops(2, 3, 100, 9, 16, backward=True) == 3 * 4 * 2 * 3 * 100 * 9 * 16
    assert band_flops(1, 1, 8, 33, 4, backward=False) == 4 * 8 * 8 * 4  # w = 33 > T = 8


def test_the_cpu_allocation_peak_counts_what_is_live_at_once():
    kept = []

    def call():
        a = torch.empty(1 << 20, dtype=torch.uint8)
        kept.append(torch.empty(1 << 21, dtype=torch.uint8))  # a and this together: 3 MiB
        del a
        torch.empty(1 << 20, dtype=torch.uint8)  # 2 + 1 MiB again, freed at once: no new peak

    assert 3 << 20 <= cpu_allocation_peak(call) < (3 << 20) + (1 << 16)


def test_the_cpu_allocation_peak_is_not_lowered_by_earlier_garbage_collected_inside_it():
    """A tensor allocated in an earlier measurement and then held only by a reference cycle lives
    until Python's collector runs; freed inside the next measurement, it would count there as a
    negative allocation and hide a peak of its size."""
    gc.disable()  # only the explicit collections below run
    try:
        held = []

        def build_garbage():
            cycle = [torch.empty(2 << 20, dtype=torch.uint8)]
            cycle.append(cycle)
            held.append(cycle)

        cpu_allocation_peak(build_garbage)
        held.clear()  # the cycle is garbage now, freed at the next collection
        kept = []

        def call():
            kept.append(torch.empty(1 << 20, dtype=torch.uint8))
            gc.collect()  # as Python's collector may run at any allocation of objects
            kept.append(torch.empty(1 << 20, dtype=torch.uint8))

        assert 2 << 20 <= cpu_allocation_peak(call) < (2 << 20) + (1 << 16)
    finally:
        gc.enable()
