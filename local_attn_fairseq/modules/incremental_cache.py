"""The keys and values an attention layer keeps between decoding steps (fairseq's incremental
state): appending a step's keys, reusing static encoder keys, the rolling window of causal-local
layers (``rolling_cache``), and reordering for the beam search.

A mixin of ``LocalMultiheadAttention``: fairseq's generator calls ``reorder_incremental_state``
and ``set_beam_size`` on the attention modules, and the state lives in the module's incremental
state under ``attn_state`` (``fairseq.incremental_decoding_utils.with_incremental_state``).
"""

from typing import Dict, List, Optional

import torch
from fairseq.modules import MultiheadAttention
from torch import Tensor

IncrementalState = Optional[Dict[str, Dict[str, Optional[Tensor]]]]


class IncrementalKeyCache:
    """Needs ``rolling_cache`` (a RollingWindowCache or None), ``dynamic_windows`` and
    ``local_k_proj`` on the module: the window mechanisms' extra keys are cached too."""

    def _extend_cached(self, saved_state, k, v, key_padding_mask, bsz, static_kv, extra_keys):
        """Append this step's keys/values (and the extra keys of the window mechanisms) to the
        cache, or reuse the cache for static encoder keys. Returns every key this step's
        queries attend to; the cache keeps what later queries can still reach."""
        if "prev_key" in saved_state:
            prev_key, prev_value = saved_state["prev_key"], saved_state["prev_value"]
            assert prev_key is not None and prev_value is not None
            cached_extra = {name: saved_state[f"prev_{name}"] for name in self._extra_key_names()}
            if static_kv or k is None:
                k, v, extra_keys = prev_key, prev_value, cached_extra
            else:
                k = torch.cat([prev_key, k], dim=2)
                v = torch.cat([prev_value, v], dim=2)
                extra_keys = {n: torch.cat([cached_extra[n], extra_keys[n]], 2) for n in extra_keys}
        key_padding_mask = MultiheadAttention._append_prev_key_padding_mask(
            key_padding_mask=key_padding_mask,
            prev_key_padding_mask=saved_state.get("prev_key_padding_mask"),
            batch_size=bsz,
            src_len=k.size(2),
            static_kv=static_kv,
        )
        if key_padding_mask is not None:  # fairseq appends in float; the banded operator takes bool
            key_padding_mask = key_padding_mask.bool()
        saved_state["prev_key"] = k
        saved_state["prev_value"] = v
        saved_state["prev_key_padding_mask"] = key_padding_mask
        for name, value in extra_keys.items():
            saved_state[f"prev_{name}"] = value
        if self.rolling_cache is not None:
            self.rolling_cache.drop_unreachable(saved_state)
        return k, v, key_padding_mask, extra_keys

    def _extra_key_names(self) -> List[str]:
        names = [f"window{g}" for g in range(len(self.dynamic_windows))]
        return names + (["local_key"] if self.local_k_proj is not None else [])

    @torch.jit.export
    def reorder_incremental_state(self, incremental_state: IncrementalState, new_order: Tensor):
        """Reorder cached keys/values to follow the beam search's new hypothesis order."""
        input_buffer = self._get_input_buffer(incremental_state)
        if input_buffer is not None:
            for name, value in input_buffer.items():
                if value is not None:
                    input_buffer[name] = value.index_select(0, new_order)
            incremental_state = self._set_input_buffer(incremental_state, input_buffer)
        return incremental_state

    def set_beam_size(self, beam_size: int):
        """Called by fairseq's generator; every cache here is simply reordered per step."""

    def _get_input_buffer(self, incremental_state: IncrementalState) -> Dict[str, Optional[Tensor]]:
        result = self.get_incremental_state(incremental_state, "attn_state")
        return result if result is not None else {}

    def _set_input_buffer(self, incremental_state, buffer: Dict[str, Optional[Tensor]]):
        return self.set_incremental_state(incremental_state, "attn_state", buffer)
