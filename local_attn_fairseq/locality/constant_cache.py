"""Tensors that depend only on sizes and settings, built once instead of on every call.

Masks, positions and index tensors of a layer are the same for every batch of the same lengths;
building them costs a few operations a call (on a GPU, kernel launches and host-to-device
copies). ``cached_constants`` keeps the most recent ones per argument tuple. The tensors are
shared: callers must never modify them in place.
"""

import functools
from typing import Callable, TypeVar

import torch

Builder = TypeVar("Builder", bound=Callable[..., object])


def cached_constants(maxsize: int) -> Callable[[Builder], Builder]:
    """Decorator of a builder whose (hashable) arguments determine its tensors."""

    def decorate(build: Builder) -> Builder:
        @functools.lru_cache(maxsize=maxsize)
        def cached(*args):
            # Normal tensors even when first asked for under inference mode: they are reused
            # in training later, where inference tensors could not be saved for backward.
            with torch.inference_mode(False):
                return build(*args)

        @functools.wraps(build)
        def get(*args):
            if torch.compiler.is_compiling():  # a traced graph builds its own (fake) tensors
                return build(*args)
            return cached(*args)

        get.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
        return get  # type: ignore[return-value]

    return decorate
