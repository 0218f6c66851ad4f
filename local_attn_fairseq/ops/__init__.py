"""Operators of the plugin: banded (local) self-attention in O(T * w) time and memory.

``banded_attention`` is the entry point and ``choose_route`` its dispatch; ``banded_reference``
holds its pure-PyTorch implementation (the fallback when the C++/CUDA extension is not built,
and the tests' reference) and ``blocked_sdpa`` the route through PyTorch's
``scaled_dot_product_attention``.
"""

from .banded_attention import (
    banded_attention,
    choose_route,
    draw_dropout_keep,
    extension_info,
    tensor_core_gap,
    use_extension,
)

__all__ = [
    "banded_attention",
    "choose_route",
    "draw_dropout_keep",
    "extension_info",
    "tensor_core_gap",
    "use_extension",
]
