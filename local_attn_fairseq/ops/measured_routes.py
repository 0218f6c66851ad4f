"""Which route of the banded operator the committed GPU records show fastest, forward +
backward, in each (dtype, head dim, T, band width) cell: what ``auto`` takes on a GPU
there. None: the records do not decide the cell (another route within 5%, or
runs that disagree), and ``auto`` keeps its default. Generated from SOURCES by
``python benchmarks/measured_routes.py`` (``ops/route_records.py``); do not edit.
"""

SOURCES = (
    "benchmarks/results/h100_short_lengths_fwd_bwd.json",
    "benchmarks/results/h200_2026-11-27/bf16_d64_fwd_bwd_checks.json",
    "benchmarks/results/h200_bf16_d32_d128_fwd_bwd.json",
    "benchmarks/results/h200_bf16_d64_fwd_bwd_grid.json",
)

CELLS = {
    ("bfloat16", 32, 4096, 257): "tensor-core",
    ("bfloat16", 64, 256, 11): None,
    ("bfloat16", 64, 256, 43): None,
    ("bfloat16", 64, 768, 11): None,
    ("bfloat16", 64, 768, 43): "tensor-core",
    ("bfloat16", 64, 1024, 33): "tensor-core",
    ("bfloat16", 64, 1024, 129): "tensor-core",
    ("bfloat16", 64, 1024, 257): "tensor-core",
    ("bfloat16", 64, 1024, 513): "tensor-core",
    ("bfloat16", 64, 1024, 1025): "tensor-core",
    ("bfloat16", 64, 1536, 11): "tensor-core",
    ("bfloat16", 64, 1536, 43): "tensor-core",
    ("bfloat16", 64, 2048, 33): "tensor-core",
    ("bfloat16", 64, 2048, 129): "tensor-core",
    ("bfloat16", 64, 2048, 257): "tensor-core",
    ("bfloat16", 64, 2048, 513): "tensor-core",
    ("bfloat16", 64, 2048, 1025): "tensor-core",
    ("bfloat16", 64, 4096, 33): "tensor-core",
    ("bfloat16", 64, 4096, 129): "tensor-core",
    ("bfloat16", 64, 4096, 257): "tensor-core",
    ("bfloat16", 64, 4096, 513): "tensor-core",
    ("bfloat16", 64, 4096, 1025): "tensor-core",
    ("bfloat16", 64, 8192, 33): "tensor-core",
    ("bfloat16", 64, 8192, 129): "tensor-core",
    ("bfloat16", 64, 8192, 257): "tensor-core",
    ("bfloat16", 64, 8192, 513): "tensor-core",
    ("bfloat16", 64, 8192, 1025): "tensor-core",
    ("bfloat16", 64, 16384, 33): "tensor-core",
    ("bfloat16", 64, 16384, 129): "tensor-core",
    ("bfloat16", 64, 16384, 257): "tensor-core",
    ("bfloat16", 64, 16384, 513): "tensor-core",
    ("bfloat16", 64, 16384, 1025): "tensor-core",
    ("bfloat16", 128, 4096, 257): "tensor-core",
    ("float16", 64, 16, 3): "tensor-core",
    ("float16", 64, 16, 17): None,
    ("float16", 64, 32, 3): "extension",
    ("float16", 64, 32, 17): None,
    ("float16", 64, 64, 3): None,
    ("float16", 64, 64, 17): "tensor-core",
    ("float16", 64, 128, 3): None,
    ("float16", 64, 128, 17): "tensor-core",
}
