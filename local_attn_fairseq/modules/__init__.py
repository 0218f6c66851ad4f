"""The attention module and the layers that use it.

- ``local_multihead_attention``: ``LocalMultiheadAttention``, the one place where the mechanisms
  of ``locality/`` are composed;
- ``attention_plan``: each layer's plan, built with it: which path (fused, banded, by head kind,
  the CPU's terms operator, explicit) computes a call, and the layer's one rule of causality;
- ``incremental_cache`` and ``rolling_cache``: the keys a layer keeps between decoding steps, and
  the rolling window of layers whose every head is causal-local;
- ``transformer_layers``: fairseq's encoder/decoder layers and stacks with that attention inside;
- ``head_pruning``: removing the heads whose gates are closed from a checkpoint.
"""
