"""The banded attention operator: kernels against the reference, gradients, opcheck."""
