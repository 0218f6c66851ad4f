"""Operators of the plugin: banded (local) self-attention in O(T * w) time and memory.

``banded_attention`` is the entry point and ``choose_route`` its dispatch; ``route_table``
declares what each route supports (``band_capabilities`` answers it for given inputs,
``unsupported_reasons`` for a call); ``banded_reference`` holds its pure-PyTorch implementation
(the fallback when the C++/CUDA extension is not built, and the tests' reference) and
``blocked_sdpa`` the route through PyTorch's ``scaled_dot_product_attention``.
"""

from .banded_attention import (
    band_capabilities,
    banded_attention,
    choose_route,
    draw_dropout_keep,
    extension_info,
    tensor_core_gap,
    unsupported_reasons,
    use_extension,
)
from .route_table import route_supports

__all__ = [
    "band_capabilities",
    "banded_attention",
    "choose_route",
    "draw_dropout_keep",
    "extension_info",
    "route_supports",
    "tensor_core_gap",
    "unsupported_reasons",
    "use_extension",
]
