"""A rolling window cache for incremental decoding (Mistral's rolling buffer) in decoder
self-attention layers whose every head is a causal local head.

While decoding, each query sits at the newest key: a local head's band is worked out from the
offsets between the query and the keys as the cache numbers them (``offset_mask`` aligns the
queries to the last keys), and the keys' padding comes with them in the cache's key padding
mask. A ``local-L`` or ``local-L-R`` head of a causal layer therefore never again reaches a key
more than L places behind the newest one, so the layer keeps only the last max(L) keys, values
and padding flags: every later query finds the keys, offsets and padding the full cache would
have given it, and a step costs O(window) instead of O(length).

Layers with any head that may reach every key keep the full cache: global heads, Pande's masks
(they multiply a softmax over all keys), Gaussian localness (its centre and window are read
from the real length) and dynamic windows (pointers over all keys). Relative positions do not
matter: the logits outside a local window are masked before the softmax.

``LOCAL_ATTN_FULL_DECODER_CACHE=1`` keeps the full cache in every layer (for comparisons); it is
read at each step, so setting it in ``os.environ`` takes effect at the next step.
"""

from typing import Dict, Optional, Sequence

from torch import Tensor

from ..locality.spec import HeadSpec
from ..ops.environment import environment_value

FULL_CACHE_VARIABLE = "LOCAL_ATTN_FULL_DECODER_CACHE"


def full_cache_forced() -> bool:
    return environment_value(FULL_CACHE_VARIABLE) not in (None, "", "0")


class RollingWindowCache:
    """Drops, after each decoding step, the cached keys that no later query can reach."""

    def __init__(self, reach: int):
        self.reach = reach  # how many past keys a later query may still attend to

    @classmethod
    def for_layer(
        cls, head_specs: Sequence[HeadSpec], causal: bool, self_attention: bool
    ) -> Optional["RollingWindowCache"]:
        """The layer's rolling cache, or None when some head needs every key."""
        if not (causal and self_attention and head_specs):
            return None
        bounds = [spec.bounds for spec in head_specs]
        local_only = all(
            b.renormalised and not spec.gaussian and spec.window is None
            for b, spec in zip(bounds, head_specs)
        )
        if not local_only:
            return None
        return cls(max(-b.lo for b in bounds))

    def drop_unreachable(self, saved_state: Dict[str, Optional[Tensor]]):
        """Keep the last ``reach`` keys, values and key padding flags of the layer's cache."""
        if full_cache_forced():
            return
        key = saved_state["prev_key"]
        start = key.size(2) - self.reach
        if start <= 0:
            return
        saved_state["prev_key"] = key[:, :, start:]
        saved_state["prev_value"] = saved_state["prev_value"][:, :, start:]
        padding = saved_state.get("prev_key_padding_mask")
        if padding is not None and padding.dim() == 2:
            saved_state["prev_key_padding_mask"] = padding[:, start:]
