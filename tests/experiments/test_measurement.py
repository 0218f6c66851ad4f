"""The benchmarks' shared measurements."""

import torch

from local_attn_fairseq.experiments.measurement import OperationCounter


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
