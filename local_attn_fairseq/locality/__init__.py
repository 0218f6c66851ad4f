"""The locality mechanisms of the papers, pure torch (no fairseq import), one file each.

- ``spec``: the locality spec, which says what every head of every attention layer does;
  validated against a model's shape before anything trains;
- ``layer_selection``: the one reader of layer selectors (``0-2``, ``1,3``, ``all``), for the spec
  and the command line;
- ``fixed_masks``: Pande et al.'s fixed binary head masks (local, previous/next, band...);
- ``gaussian``: Yang et al.'s learned Gaussian localness bias;
- ``relative_position``: Shaw et al.'s relative position representations (Yang et al.'s setup);
- ``dynamic_window``: Nguyen et al.'s differentiable windows (multiplicative and additive);
- ``head_gates``: Voita et al.'s Hard Concrete head gates and their L0 penalty;
- ``masked_softmax``: the softmax that gives zeros, not NaN, for a row with no allowed key.

``modules.local_multihead_attention`` composes them in the one order of DESIGN.md.
"""
