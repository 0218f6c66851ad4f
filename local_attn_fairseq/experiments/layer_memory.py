"""Training memory of one attention layer of each mechanism that runs on the CPU operators
(``ops/mechanisms.py``): Nguyen et al.'s multiplicative (MW) and additive (AW) windows, Yang et
al.'s Gaussian localness, and the Gaussian bias beside an additive window over segments.

Two figures per layer and length, on torch's CPU allocation counter
(``measurement.cpu_allocation_peak``):

* the peak over one forward + backward (``measurement.peak_bytes``);
* what the forward leaves allocated for the backward beyond the tensors autograd saved for it
  (``saved_tensors_hooks`` sees them) and the output. A graph that keeps nothing else leaves 0
  here; anything more is held only by some node's own bookkeeping.
"""

import gc
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Sequence, Set, Tuple

import torch
from torch.utils._pytree import tree_leaves

from ..locality.spec import HeadSpec
from ..modules.local_multihead_attention import LocalMultiheadAttention
from .measurement import cpu_allocation_peak, peak_bytes

# Every head of a layer alike; the names are the heads' spec tokens.
LAYERS: Dict[str, HeadSpec] = {
    "mw": HeadSpec(window="mw"),
    "aw": HeadSpec(window="aw"),
    "gaussian": HeadSpec(gaussian=True),
    "gaussian+aw-seg5": HeadSpec(gaussian=True, window="aw", segment=5),
}
MiB = 2**20


def build_layer(name: str, embed_dim: int, heads: int) -> LocalMultiheadAttention:
    """An encoder self-attention layer whose every head is ``LAYERS[name]``, in training mode
    without attention dropout."""
    if name not in LAYERS:
        raise ValueError(f"unknown layer {name!r}: use one of {', '.join(LAYERS)}")
    torch.manual_seed(0)
    layer = LocalMultiheadAttention(
        embed_dim, heads, head_specs=[LAYERS[name]] * heads, self_attention=True
    )
    layer.bind_qk_owners([layer])
    return layer.train()


def layer_input(layer: LocalMultiheadAttention, length: int, batch: int) -> torch.Tensor:
    return torch.randn(length, batch, layer.embed_dim, requires_grad=True)


def attention_output(layer: LocalMultiheadAttention, x: torch.Tensor) -> torch.Tensor:
    return layer(x, x, x, need_weights=False)[0]


def peak_training_bytes(layer: LocalMultiheadAttention, length: int, batch: int) -> int:
    """Peak bytes of one forward + backward of ``layer`` on a (length, batch) input, above what
    was allocated before (the parameters' gradients included, which the call allocates)."""
    x = layer_input(layer, length, batch)
    layer.zero_grad(set_to_none=True)
    peak = peak_bytes(lambda x: attention_output(layer, x), [x], backward=True)
    layer.zero_grad(set_to_none=True)
    return peak


def bytes_left_allocated(call: Callable[[], object]) -> Tuple[object, int]:
    """What ``call()`` returns, and the bytes of torch's CPU allocations it made and left
    allocated (what it returns, and the autograd graph that holds on to). On
    ``cpu_allocation_peak``'s counter: an allocation larger than the call's own peak, made
    right after the call, puts the peak at what is left plus that allocation."""
    probe = 2 * cpu_allocation_peak(call) + MiB  # the call's own peak, with a wide margin
    gc.collect()  # none of that call's garbage freed while the next one is counted
    results: List[object] = []

    def call_then_probe():
        results.append(call())
        torch.empty(probe, dtype=torch.uint8)

    left = cpu_allocation_peak(call_then_probe) - probe
    return results[0], left


def storage_addresses(tensors: Iterable[torch.Tensor]) -> Set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


class SavedStorages:
    """The storages of the tensors autograd saves for the backward while it is active (a
    ``saved_tensors_hooks`` context), other than those at ``existing`` addresses, by address."""

    def __init__(self, existing: Iterable[int] = ()):
        self.existing = set(existing)
        self.sizes: Dict[int, int] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.existing:
            self.sizes[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self):
        self.sizes.clear()
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    def total(self) -> int:
        return sum(self.sizes.values())


@dataclass
class ForwardMemory:
    left: int  # bytes the forward left allocated: outputs, saved tensors and anything else held
    saved: int  # bytes of the new storages autograd saved for the backward
    output: int  # bytes of the outputs' storages that are not among them

    @property
    def beyond_saved(self) -> int:
        """Bytes held for the backward outside the saved tensors (and the outputs)."""
        return self.left - self.saved - self.output


def forward_memory(
    forward: Callable[[], object], known: Iterable[torch.Tensor]
) -> ForwardMemory:
    """What ``forward()`` leaves allocated for its backward, against the tensors autograd saved
    for it other than the ``known`` ones (its inputs and parameters, allocated before)."""
    addresses = storage_addresses(known)
    # A first forward builds what the caller caches (a layer's tensors for the length). Its
    # graph is held while the measured ones run, so no storage it saved can be freed and
    # reused: those they save too are the caches, allocated before them.
    with SavedStorages(addresses) as first:
        first_outputs = forward()
    saved = SavedStorages(addresses | set(first.sizes))

    def measured():
        with saved:
            return forward()

    outputs, left = bytes_left_allocated(measured)
    del first_outputs  # held until here (above)
    output_sizes = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in tree_leaves(outputs)
        if isinstance(t, torch.Tensor)
    }
    output = sum(n for address, n in output_sizes.items() if address not in saved.sizes)
    return ForwardMemory(left, saved.total(), output)


def layer_forward_memory(layer: LocalMultiheadAttention, length: int, batch: int) -> ForwardMemory:
    """What a training forward of ``layer`` on a (length, batch) input leaves for its backward."""
    x = layer_input(layer, length, batch)
    return forward_memory(lambda: attention_output(layer, x), [x, *layer.parameters()])


def memory_table(
    names: Sequence[str], lengths: Sequence[int], embed_dim: int, heads: int, batch: int
) -> str:
    """A markdown table: per layer and length, the peak of a forward + backward and the bytes
    the forward left held beyond the backward's saved tensors, in MiB."""
    rows = [
        "| layer | T | peak forward + backward MiB | saved for backward MiB "
        "| held beyond them MiB |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in names:
        for length in lengths:
            peak = peak_training_bytes(build_layer(name, embed_dim, heads), length, batch)
            kept = layer_forward_memory(build_layer(name, embed_dim, heads), length, batch)
            rows.append(
                f"| {name} | {length} | {peak / MiB:.1f} | {kept.saved / MiB:.1f} "
                f"| {kept.beyond_saved / MiB:.1f} |"
            )
    return "\n".join(rows)
