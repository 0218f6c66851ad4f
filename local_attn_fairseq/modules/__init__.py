"""The attention module and the layers that use it.

- ``local_multihead_attention``: ``LocalMultiheadAttention``, the one place where the mechanisms
  of ``locality/`` are composed, and where a layer picks the banded operator or the fused path;
- ``transformer_layers``: fairseq's encoder/decoder layers and stacks with that attention inside;
- ``head_pruning``: removing the heads whose gates are closed from a checkpoint.
"""
