"""LocalMultiheadAttention: fairseq's multi-head attention with per-head locality mechanisms.

This is the one place where mechanisms are composed, always in this order (see DESIGN.md):

1. project q, k, v; heads may use the Wq/Wk of another head, of this layer or of another layer
   (tying: the parameters exist once, in the owning layer);
2. logits = q k^T / sqrt(d), plus the additive terms: relative positions (Shaw et al.), the
   Gaussian localness bias (Yang et al.) and the additive window's local scores s_loc * M / sqrt(d)
   (Nguyen et al. AW, from the heads' own local Q/K projections);
3. causal and key-padding masks (a query with no allowed key gets zeros, never NaN);
4. softmax;
5. post-softmax multipliers: fixed binary head masks (Pande et al.: weights keep the values of
   the softmax over all keys, so they need not sum to one) and the multiplicative window's soft
   mask M (Nguyen et al. MW);
6. attention dropout, times v (plus the relative position values);
7. per-head gates (Voita et al.: Hard Concrete, sampled in training, 0 or 1 at test time),
   then the output projection.

A pruned layer holds only its kept heads (smaller V and output projections, fewer Q/K rows);
head specs and ties keep the unpruned numbering.

Heads that share Wq/Wk within a layer compute their logits and softmax once; the distinct
Q/K "groups" are expanded to heads just before the per-head masks. A layer with only global,
untied heads takes PyTorch's fused ``scaled_dot_product_attention`` path, so the plain
Transformer costs what fairseq's own ``MultiheadAttention`` costs. Layers whose per-head
mechanisms are only fixed masks and windows need no T x T matrix either when a whole sequence
attends to itself and nobody asks for the weights: a layer of local heads is one call of the
banded operator; in a layer with Pande's band heads, each kind of head takes its own path (band
heads: the band of the full softmax, ``ops.band_with_global_lse``; local heads: the banded
operator; global heads: the fused path), with the same outputs as steps 1-7 above. On the CPU,
a layer whose Gaussian bias, dynamic windows or Pande's masks cover every head (and that has
nothing else, each head with its own Q/K) runs steps 2-6 as C++ operators
(``ops.mechanisms``): the attention that takes the terms, in the same call as the Gaussian bias
or the one window's mask (or AW's term) where the layer has one of them, and one more call for
each other term. On the CPU too, step 1 is one C++ call for every projection of the keys (and
of the queries, in self-attention): Q, K, V, the windows' pointer keys and AW's local keys.
Under ``LOCAL_ATTN_MECHANISM_IMPL=sdpa`` a layer whose only mechanism is the Gaussian bias on
every head gives the bias, with the causal and padding masks, to ``scaled_dot_product_attention``
as its additive mask (steps 2-6 in one call).

Which of these paths computes a call is the layer's plan (``attention_plan``), built with the
layer; so is its causality: a causal layer's queries never see a later key on any path, and a
caller's ``attn_mask`` is honoured on top of it, never replaced.

The call signature, incremental state and returned weights follow
``fairseq.modules.MultiheadAttention``, so fairseq's encoder and decoder layers, the sequence
generator and alignment code use it unchanged (``incremental_cache``). A decoder self-attention
layer whose every head is causal-local keeps only the keys its windows still reach in that state
(``rolling_cache``).
"""

import math
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from fairseq.incremental_decoding_utils import with_incremental_state
from fairseq.modules.fairseq_dropout import FairseqDropout
from torch import Tensor, nn

from ..locality.dynamic_window import DynamicWindow
from ..locality.fixed_masks import MaskBounds, offset_mask
from ..locality.gaussian import GaussianLocalness
from ..locality.head_gates import DEFAULT_GATE_INIT, HardConcreteGates
from ..locality.masked_softmax import safe_softmax
from ..locality.relative_position import RelativePositions
from ..locality.spec import LOCALNESS_DEFAULTS, HeadSpec
from ..ops import mechanisms
from ..ops.band_with_global_lse import all_keys_logsumexp, band_of_full_softmax
from ..ops.banded_attention import banded_attention, draw_dropout_keep
from ..ops.fused_attention import fused_attention
from .attention_plan import AttentionPlan, Path
from .incremental_cache import IncrementalKeyCache, IncrementalState
from .rolling_cache import RollingWindowCache


@with_incremental_state
class LocalMultiheadAttention(IncrementalKeyCache, nn.Module):
    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        dropout: float = 0.0,
        bias: bool = True,
        self_attention: bool = False,
        encoder_decoder_attention: bool = False,
        head_specs: Optional[Sequence[HeadSpec]] = None,
        layer_index: int = 0,
        attention_type: Optional[str] = None,
        causal: bool = False,
        localness: Optional[dict] = None,
        relative_max_distance: Optional[int] = None,
        relative_values: bool = False,
        kept_heads: Optional[Sequence[int]] = None,
        qk_rows: Optional[Sequence[int]] = None,
        gates: Optional[dict] = None,
        banded_kernel: bool = True,
    ):
        """``num_heads`` and ``head_specs`` describe the unpruned layer; a pruned layer has only
        ``kept_heads`` of them (and holds the Wq/Wk rows of the heads in ``qk_rows``, which
        kept heads of this or other layers use). ``gates``: Hard Concrete settings, or None.
        ``banded_kernel=False`` computes local heads by masking the T x T logits instead of
        through the banded operator (same outputs; for comparison and analysis)."""
        super().__init__()
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.head_dim = embed_dim // num_heads
        all_specs = tuple(head_specs) if head_specs else (HeadSpec(),) * num_heads
        if len(all_specs) != num_heads:
            raise ValueError(f"{len(all_specs)} head specs for {num_heads} heads")
        self.kept_heads = list(range(num_heads)) if kept_heads is None else list(kept_heads)
        self.num_heads = len(self.kept_heads)
        self.scaling = self.head_dim**-0.5
        self.self_attention = self_attention
        self.encoder_decoder_attention = encoder_decoder_attention
        self.dropout_module = FairseqDropout(dropout, module_name=self.__class__.__name__)
        self.layer_index = layer_index
        self.attention_type = attention_type  # encoder_self, decoder_self or decoder_cross
        self.causal = causal  # decoder self-attention: what each query sees grows with it

        self.head_specs = tuple(all_specs[h] for h in self.kept_heads)
        bounds = [spec.bounds for spec in self.head_specs]
        everything = MaskBounds(None, None)
        # Pande's masks multiply the softmax; local heads' windows mask the logits before it.
        self.mask_bounds = [everything if b.renormalised else b for b in bounds]
        self.has_head_masks = any(not b.is_global for b in self.mask_bounds)
        self.window_bounds = [b if b.renormalised else everything for b in bounds]
        self.has_local_heads = any(b.renormalised for b in bounds)
        self.all_heads_local = bool(bounds) and all(b.renormalised for b in bounds)
        # Heads by kind, for layers computed kind by kind without a T x T matrix.
        self.band_heads = [h for h, b in enumerate(self.mask_bounds) if not b.is_global]
        self.local_heads = [h for h, b in enumerate(bounds) if b.renormalised]
        self.global_heads = [h for h, b in enumerate(bounds) if b.is_global]
        # decoding keeps only the keys the windows still reach where every head is causal-local
        self.rolling_cache = RollingWindowCache.for_layer(self.head_specs, causal, self_attention)

        def source(h):
            return all_specs[h].qk_owner or (layer_index, h)

        # Gaussian localness reads the whole query vector, so its layers keep every Q/K source.
        gaussian_layer = any(spec.gaussian for spec in all_specs)
        query_heads = range(num_heads) if gaussian_layer else self.kept_heads
        # Heads whose Wq/Wk rows live in this layer's q_proj/k_proj, in order.
        if qk_rows is None:
            qk_rows = sorted({source(h)[1] for h in query_heads if source(h)[0] == layer_index})
        self.owned_heads = list(qk_rows)
        # Distinct (layer, head) Wq/Wk sources this layer uses, and each head's source index.
        self.qk_sources: List[Tuple[int, int]] = []
        for h in query_heads:
            if source(h) not in self.qk_sources:
                self.qk_sources.append(source(h))
        head_to_group = [self.qk_sources.index(source(h)) for h in self.kept_heads]
        self.num_qk_groups = len(self.qk_sources)
        self.register_buffer("head_to_group", torch.tensor(head_to_group), persistent=False)
        # a pruned Gaussian layer computes the Q/K of every head, more groups than kept heads
        self.groups_are_heads = head_to_group == list(range(self.num_qk_groups))
        # Q/K groups of the band heads: their log-sum-exp over all keys is computed once a group
        self.band_groups = sorted({head_to_group[h] for h in self.band_heads})
        self.band_head_group = [self.band_groups.index(head_to_group[h]) for h in self.band_heads]
        self.uses_own_qk_only = self.qk_sources == [(layer_index, h) for h in self.owned_heads]

        qk_out = len(self.owned_heads) * self.head_dim
        inner_dim = self.num_heads * self.head_dim
        self.q_proj = nn.Linear(embed_dim, qk_out, bias=bias) if qk_out else None
        self.k_proj = nn.Linear(self.kdim, qk_out, bias=bias) if qk_out else None
        self.v_proj = nn.Linear(self.vdim, inner_dim, bias=bias) if inner_dim else None
        # With every head pruned only out_proj's bias is left: the residual path plus a constant.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Initializing zero-element tensors")
            self.out_proj = nn.Linear(inner_dim, embed_dim, bias=bias)
        self.head_gates = (
            HardConcreteGates(
                self.num_heads,
                gates["temperature"],
                gates["log_alpha_init"],
                init=gates.get("init", DEFAULT_GATE_INIT),
            )
            if gates is not None and self.num_heads
            else None
        )

        self.gaussian_heads = [h for h, s in enumerate(self.head_specs) if s.gaussian]
        self.localness = None
        if self.gaussian_heads:
            settings = {**LOCALNESS_DEFAULTS, **(localness or {})}
            qk_width = self.num_qk_groups * self.head_dim
            self.localness = GaussianLocalness(
                qk_width,
                qk_width,
                len(self.gaussian_heads),
                settings["window"],
                settings["fixed_window"],
                settings["max_window"],
                centre=settings["centre"],
            )
            self.register_buffer(
                "gaussian_head_index", torch.tensor(self.gaussian_heads), persistent=False
            )
        self.record_localness = False  # analysis: keep the last centres and windows
        self.last_localness: Optional[Tuple[Tensor, Tensor]] = None
        self.relative_positions = (
            RelativePositions(self.head_dim, relative_max_distance, relative_values)
            if relative_max_distance
            else None
        )
        self._build_dynamic_windows(bias)
        # Layers whose mechanisms are per-head terms covering every head (the Gaussian bias, one
        # kind of dynamic window, Pande's masks) and nothing else: on the CPU, steps 2-6 are one
        # C++ operator. Not for heads that share Q/K: the operator computes every head's logits
        # and softmax, where the explicit path computes one per shared group (Pande's tied
        # model trained slower through it at the demo's sizes, 0.98 against 1.13 of the
        # baseline's words/s).
        self.terms_cover_every_head = (
            bool(self.gaussian_heads or self.dynamic_windows or self.has_head_masks)
            and len(self.gaussian_heads) in (0, self.num_heads)
            and (not self.dynamic_windows or self.aw_covers_all_heads or self.mw_covers_all_heads)
            and not self.has_local_heads
            and self.relative_positions is None
            and self.groups_are_heads
        )
        # A layer whose only mechanism is the Gaussian bias on every head, each head with its
        # own Q/K: its bias can be the additive mask of scaled_dot_product_attention
        # (mechanisms.gaussian_bias_through_sdpa).
        self.gaussian_only = (
            len(self.gaussian_heads) == self.num_heads > 0
            and not (self.has_local_heads or self.has_head_masks or self.dynamic_windows)
            and self.relative_positions is None
            and self.groups_are_heads
        )
        self.plan = AttentionPlan(
            causal=causal,
            self_attention=self_attention,
            banded_kernel=banded_kernel,
            plain_heads=self.groups_are_heads and not (
                self.has_local_heads or self.has_head_masks or self.gaussian_heads
                or self.relative_positions is not None or self.dynamic_windows
            ),
            gaussian_only=self.gaussian_only,
            fixed_masks_only=not (
                self.gaussian_heads or self.relative_positions is not None
                or self.dynamic_windows
            ),
            all_heads_local=self.all_heads_local,
            has_band_heads=self.has_head_masks,
            has_local_and_global_heads=bool(self.local_heads and self.global_heads),
            terms_cover_every_head=self.terms_cover_every_head,
        )  # fmt: skip
        # Modules holding the Wq/Wk of other layers; kept out of _modules so that a tied
        # parameter is registered (and saved, counted, averaged) exactly once.
        self._qk_owner_modules: Dict[int, "LocalMultiheadAttention"] = {}
        # What depends only on the layer's heads, worked out on first use instead of per call.
        self._band_windows_by_heads: Dict[Tuple[int, ...], Tuple[List[int], List[int]]] = {}
        self._head_index_cache: Dict[Tuple[Tuple[int, ...], torch.device], Tensor] = {}
        self.reset_parameters()

    @property
    def banded_kernel(self) -> bool:
        return self.plan.banded_kernel

    @banded_kernel.setter
    def banded_kernel(self, value: bool):
        self.plan.banded_kernel = bool(value)

    def _build_dynamic_windows(self, bias: bool):
        """Nguyen et al.'s pointers, one DynamicWindow per segment size used in this layer, and
        the separate local Q/K projections of the additive-window (AW) heads."""
        window_heads = [h for h, spec in enumerate(self.head_specs) if spec.window]
        segments = sorted({self.head_specs[h].segment or 0 for h in window_heads})
        self.window_groups = [
            [h for h in window_heads if (self.head_specs[h].segment or 0) == seg]
            for seg in segments
        ]
        self.dynamic_windows = nn.ModuleList(
            DynamicWindow(self.embed_dim, self.kdim, len(heads), self.head_dim, seg or None)
            for seg, heads in zip(segments, self.window_groups)
        )
        order = [h for heads in self.window_groups for h in heads]  # rows of the window masks
        aw = [i for i, h in enumerate(order) if self.head_specs[h].window == "aw"]
        mw = [i for i, h in enumerate(order) if self.head_specs[h].window == "mw"]
        for name, rows in (("aw", aw), ("mw", mw)):
            self.register_buffer(f"{name}_rows", torch.tensor(rows, dtype=torch.long), False)
            heads = torch.tensor([order[i] for i in rows], dtype=torch.long)
            self.register_buffer(f"{name}_heads", heads, False)
        # A layer whose every head has the same method (the paper's layouts) needs no indexing.
        every_head = list(range(self.num_heads))
        self.aw_covers_all_heads = order == every_head and len(aw) == self.num_heads
        self.mw_covers_all_heads = order == every_head and len(mw) == self.num_heads
        # every head an AW head, or every head an MW head, of one window: on the CPU, the
        # window's mask (or AW's term) comes from the attention's own C++ call
        self.single_window = len(self.window_groups) == 1 and (
            self.aw_covers_all_heads or self.mw_covers_all_heads
        )
        width = len(aw) * self.head_dim
        self.local_q_proj = nn.Linear(self.embed_dim, width, bias=bias) if aw else None
        self.local_k_proj = nn.Linear(self.kdim, width, bias=bias) if aw else None

    def reset_parameters(self):
        # Same initialisation as fairseq's MultiheadAttention.
        gain = 1 / math.sqrt(2) if self.kdim == self.vdim == self.embed_dim else 1.0
        projections = (self.q_proj, self.k_proj, self.v_proj, self.local_q_proj, self.local_k_proj)
        for proj in projections:
            if proj is not None:
                nn.init.xavier_uniform_(proj.weight, gain=gain)
        if self.num_heads:
            nn.init.xavier_uniform_(self.out_proj.weight)
        if self.out_proj.bias is not None:
            nn.init.constant_(self.out_proj.bias, 0.0)

    def upgrade_state_dict_named(self, state_dict, name):
        """Gates added to a model trained without them (pruning by fine-tuning, Voita et al.
        6.1) start from their initial values instead of failing the strict load."""
        if self.head_gates is not None:
            key = f"{name}.head_gates.log_alpha" if name else "head_gates.log_alpha"
            if key not in state_dict:
                state_dict[key] = self.head_gates.log_alpha.detach().clone()

    # -- tying ------------------------------------------------------------------------------
    def bind_qk_owners(self, attention_by_layer: Sequence["LocalMultiheadAttention"]):
        """Point this layer at the modules that own the Wq/Wk it borrows (tied across layers)."""
        owners = {}
        for layer, head in self.qk_sources:
            owner = self if layer == self.layer_index else attention_by_layer[layer]
            if head not in owner.owned_heads:
                raise ValueError(
                    f"layer {self.layer_index} borrows Wq/Wk of layer {layer} head {head}, "
                    "which does not own them"
                )
            owners[layer] = owner
        object.__setattr__(self, "_qk_owner_modules", owners)

    def _qk_projection(self, which: str) -> Tuple[Tensor, Optional[Tensor]]:
        """Weight and bias projecting to the Q (or K) of every group, gathered from the owners."""
        if self.uses_own_qk_only:
            proj = getattr(self, which)
            return proj.weight, proj.bias
        weights, biases = [], []
        d = self.head_dim
        for layer, head in self.qk_sources:
            owner = self if layer == self.layer_index else self._qk_owner_modules.get(layer)
            if owner is None:
                raise RuntimeError(
                    f"layer {self.layer_index} uses Wq/Wk of layer {layer}: call bind_qk_owners"
                )
            proj = getattr(owner, which)
            row = owner.owned_heads.index(head) * d
            weights.append(proj.weight[row : row + d])
            if proj.bias is not None:
                biases.append(proj.bias[row : row + d])
        return torch.cat(weights), (torch.cat(biases) if biases else None)

    def _project_qk(self, x: Tensor, which: str) -> Tensor:
        """(len, bsz, dim) -> (bsz, groups, len, head_dim)."""
        weight, bias = self._qk_projection(which)
        length, bsz = x.shape[:2]
        y = F.linear(x, weight, bias)
        return y.view(length, bsz, self.num_qk_groups, self.head_dim).permute(1, 2, 0, 3)

    def _project(self, query: Tensor, key: Optional[Tensor], value: Optional[Tensor]):
        """q (bsz, groups, tgt_len, head_dim), k likewise, v (bsz, heads, src_len, head_dim)
        and the window keys (:meth:`_project_window_keys`); k, v and the window keys are None
        (empty) without a key (cached keys while decoding)."""
        # (weights of mixed dtypes or devices fail in the operator as they do in F.linear)
        one_call = key is not None and value is key
        if one_call and mechanisms.cpu_operators_apply(query, key, self.v_proj.weight):
            return self._project_in_one_call(query, key)
        q = self._project_qk(query, "q_proj")
        k = self._project_qk(key, "k_proj") if key is not None else None
        v = self._project_v(value) if value is not None else None
        window_keys = self._project_window_keys(key) if key is not None else {}
        return q, k, v, window_keys

    def _project_in_one_call(self, query: Tensor, key: Tensor):
        """:meth:`_project` of keys that are the values too (self-attention, encoder-decoder
        attention): every projection of the keys, and of the queries where they are the keys,
        in one C++ call (ops/mechanisms.py)."""
        with_query = query is key
        windows = self.dynamic_windows
        projections = [self._qk_projection("k_proj"), (self.v_proj.weight, self.v_proj.bias)]
        if with_query:
            projections.append(self._qk_projection("q_proj"))
        projections += [(window.key_pointers.weight, None) for window in windows]
        if self.local_k_proj is not None:
            projections.append((self.local_k_proj.weight, self.local_k_proj.bias))
        k, v, *rest = mechanisms.project_heads(key, projections, self.head_dim)
        q, rest = (rest[0], rest[1:]) if with_query else (self._project_qk(query, "q_proj"), rest)
        window_keys = {f"window{g}": rest[g] for g in range(len(windows))}
        if self.local_k_proj is not None:
            window_keys["local_key"] = rest[-1]
        return q, k, v, window_keys

    def _project_v(self, x: Tensor) -> Tensor:
        length, bsz = x.shape[:2]
        y = self.v_proj(x)
        return y.view(length, bsz, self.num_heads, self.head_dim).permute(1, 2, 0, 3)

    # -- forward ----------------------------------------------------------------------------
    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: IncrementalState = None,
        need_weights: bool = True,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """Shapes as in fairseq: query (tgt_len, bsz, embed_dim); returns the output and, if
        asked, the attention weights after the head masks (averaged over heads, or per head
        (heads, bsz, tgt_len, src_len) with ``need_head_weights``)."""
        if need_head_weights:
            need_weights = True
        tgt_len, bsz, _ = query.size()
        if self.num_heads == 0:
            return self._without_heads(query, key, need_weights, need_head_weights)

        saved_state = None
        if incremental_state is not None:
            saved_state = self._get_input_buffer(incremental_state)
            if saved_state and "prev_key" in saved_state and static_kv:
                key = value = None  # encoder-decoder attention: keys computed at step 0

        q, k, v, window_keys = self._project(query, key, value)

        if saved_state is not None:
            k, v, key_padding_mask, window_keys = self._extend_cached(
                saved_state, k, v, key_padding_mask, bsz, static_kv, window_keys
            )
            self._set_input_buffer(incremental_state, saved_state)
        assert k is not None and v is not None
        src_len = k.size(2)
        if key_padding_mask is not None and key_padding_mask.dim() == 0:
            key_padding_mask = None
        if key_padding_mask is not None:
            assert key_padding_mask.shape == (bsz, src_len), key_padding_mask.shape

        path = self.plan.path(q, v, src_len, attn_mask, need_weights or before_softmax)
        if path is not Path.EXPLICIT:
            compute = getattr(self, _PATH_METHODS[path])
            out = compute(q, k, v, query, window_keys, key_padding_mask, attn_mask)
            return self._merge_heads(out, tgt_len, bsz), None

        scaled_q = q * self.scaling
        logits = torch.matmul(scaled_q, k.transpose(-1, -2))  # (bsz, groups, tgt, src)
        rel_index = None
        if self.relative_positions is not None:
            rel_index = self.relative_positions.index(tgt_len, src_len, q.device)
            logits = logits + self.relative_positions.key_logits(scaled_q, rel_index)
        # per-head biases need per-head logits
        per_head = self.localness is not None or bool(self.dynamic_windows) or self.has_local_heads
        if per_head:
            logits = self._expand_groups(logits).float()
        if self.has_local_heads:
            allowed = offset_mask(self.window_bounds, tgt_len, src_len, logits.device)
            logits = logits.masked_fill(~allowed, float("-inf"))
        if self.localness is not None:
            logits = self._add_localness(logits, q, k, key_padding_mask)
        windows = None
        if self.dynamic_windows:
            windows = self._window_masks(query, window_keys, key_padding_mask)
            if self.local_q_proj is not None:
                logits = self._add_local_window_scores(logits, query, window_keys, windows)
        mask = self.plan.additive_mask(attn_mask, tgt_len, src_len, logits.dtype, logits.device)
        if mask is not None:  # the caller's mask and the layer's causality
            logits = logits + mask
        no_key = None  # sentences without a single real key
        if key_padding_mask is not None:
            padding = key_padding_mask.to(torch.bool)
            no_key = padding.all(dim=-1)
            # Leave their rows unmasked (finite), and zero what they produce further down.
            padding = padding & ~no_key[:, None]
            logits = logits.masked_fill(padding[:, None, None, :], float("-inf"))
        if before_softmax:
            return (logits if per_head else self._expand_groups(logits)), v

        if self.plan.rows_may_lack_keys(attn_mask, key_padding_mask) or self.has_local_heads:
            # so may a window over padding only
            probs = safe_softmax(logits, dim=-1)
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if not per_head:
            probs = self._expand_groups(probs)
        if self.has_head_masks:
            probs = probs * offset_mask(self.mask_bounds, tgt_len, src_len, probs.device)
        if windows is not None and self.mw_covers_all_heads:
            probs = probs * windows  # multiplicative window (Eq. 13): softmax(score) * M
        elif windows is not None and len(self.mw_heads):
            windowed = probs.index_select(1, self.mw_heads) * windows.index_select(1, self.mw_rows)
            probs = probs.index_copy(1, self.mw_heads, windowed)
        weights = probs
        probs = self.dropout_module(probs if probs.dtype == v.dtype else probs.to(v.dtype))
        out = torch.matmul(probs, v)  # (bsz, heads, tgt, head_dim)
        if rel_index is not None:
            value_term = self.relative_positions.value_term(probs, rel_index)
            if value_term is not None:
                out = out + value_term
        if no_key is not None:
            out = out.masked_fill(no_key[:, None, None, None], 0.0)
        out = self._merge_heads(out, tgt_len, bsz)

        attn_weights = None
        if need_weights:
            if no_key is not None:
                weights = weights.masked_fill(no_key[:, None, None, None], 0.0)
            attn_weights = weights.to(query.dtype).transpose(0, 1)  # (heads, bsz, tgt, src)
            if not need_head_weights:
                attn_weights = attn_weights.mean(dim=0)
        return out, attn_weights

    def _add_localness(self, logits, q, k, key_padding_mask):
        """Add the Gaussian bias to the logits (bsz, heads, tgt, src) of the Gaussian heads."""
        if len(self.gaussian_heads) == self.num_heads:
            return self._localness_term(q, k, key_padding_mask, logits)
        result = self._localness_term(q, k, key_padding_mask)
        return logits.index_add(1, self.gaussian_head_index, result)

    def _localness_term(self, q, k, key_padding_mask, logits=None):
        """The Gaussian heads' float32 bias (bsz, Gaussian heads, tgt, src), or ``logits`` plus
        the bias of every head in one operation."""
        flat_q = _full_query(q)
        # only the layer strategy reads the keys' values; the others their sizes (no copy)
        flat_k = k.transpose(1, 2)
        if self.localness.strategy == "layer":
            flat_k = flat_k.flatten(2)
        result, centre, window = self.localness(
            flat_q, flat_k, key_padding_mask, self.causal, logits
        )
        if self.record_localness:
            self.last_localness = (centre.detach(), window.detach())
        return result

    def _gaussian_sdpa_attention(self, q, k, v, query, window_keys, key_padding_mask, attn_mask):
        """Steps 2-6 of a layer whose every head has the Gaussian bias (and nothing else) in
        one ``scaled_dot_product_attention`` call, the bias with the causal and padding masks
        as its additive mask.

        Rows without a single key are left unmasked and their outputs zeroed, as on the
        explicit route. In half precision each row of the float32 mask is first shifted by its
        largest value, which softmax ignores: a narrow window's bias (-2 (j - P)^2 / D^2) can
        be below float16's range on every key of a row, which would make the row all -inf, and
        bfloat16 keeps the differences between large biases only after the shift.
        """
        mask = self._localness_term(q, k, key_padding_mask)  # float32 (bsz, heads, tgt, src)
        tgt_len, src_len = q.size(2), k.size(2)
        blocked = self.plan.additive_mask(attn_mask, tgt_len, src_len, mask.dtype, mask.device)
        if blocked is not None:
            blocked = blocked[None, None]
        blocked = _additive_mask(key_padding_mask, blocked, mask.dtype, mask.device)
        no_key = None
        if blocked is not None:
            no_key = torch.isneginf(blocked).all(dim=-1, keepdim=True)
            mask = mask + blocked.masked_fill(no_key, 0.0)
        if q.dtype in (torch.float16, torch.bfloat16):
            mask = mask - mask.amax(dim=-1, keepdim=True).detach()
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask.to(q.dtype),
            dropout_p=self._attention_dropout_p(),
            scale=self.scaling,
        )
        return out if no_key is None else out.masked_fill(no_key, 0.0)

    # -- dynamic windows (Nguyen et al.) -----------------------------------------------------
    def _project_window_keys(self, key: Tensor) -> Dict[str, Tensor]:
        """The keys of the window pointers and of the AW local scores, each (bsz, heads', len,
        head_dim): cached with the attention's keys while decoding."""
        keys = {}
        if not self.dynamic_windows:  # (the AW heads' local keys come with their windows)
            return keys
        key_rows = key.transpose(0, 1)
        for g, window in enumerate(self.dynamic_windows):
            keys[f"window{g}"] = window.project_keys(key_rows)
        if self.local_k_proj is not None:
            keys["local_key"] = self._split(self.local_k_proj(key))
        return keys

    def _split(self, x: Tensor) -> Tensor:
        """(len, bsz, n * head_dim) -> (bsz, n, len, head_dim)."""
        length, bsz, width = x.shape
        return x.view(length, bsz, width // self.head_dim, self.head_dim).permute(1, 2, 0, 3)

    def _window_masks(self, query, window_keys, key_padding_mask) -> Tensor:
        """The soft masks M (bsz, window heads, tgt, src) in float32, groups one after another."""
        query_rows = query.transpose(0, 1)
        masks = [
            window(query_rows, None, key_padding_mask, self.causal, window_keys[f"window{g}"])
            for g, window in enumerate(self.dynamic_windows)
        ]
        return masks[0] if len(masks) == 1 else torch.cat(masks, dim=1)

    def _add_local_window_scores(self, logits, query, window_keys, windows):
        """Additive window (Eqs. 14-16): the AW heads' logits gain s_loc * M / sqrt(d), from their
        own local Q/K projections; padding and causal masks come after (M is 0 there)."""
        if self.aw_covers_all_heads:
            return logits + self._local_window_scores(query, window_keys, windows)
        local_scores = self._local_window_scores(
            query, window_keys, windows.index_select(1, self.aw_rows)
        )
        return logits.index_add(1, self.aw_heads, local_scores)

    def _local_window_scores(self, query, window_keys, aw_windows):
        """s_loc * M / sqrt(d) of the AW heads, from their windows M."""
        local_q = self._split(self.local_q_proj(query)).float() * self.scaling
        local_scores = torch.matmul(local_q, window_keys["local_key"].float().transpose(-1, -2))
        return local_scores * aw_windows

    # -- every head's terms in one operator (CPU) ---------------------------------------------
    def _attention_with_terms(self, q, k, v, query, window_keys, key_padding_mask, attn_mask):
        """Steps 2-6 for a layer whose Gaussian bias, dynamic windows or Pande's masks cover
        every head: the terms from their mechanisms, then the softmax, the post-softmax
        multipliers, dropout and the product with v in one C++ call (ops/mechanisms.py), as the
        explicit path computes them."""
        bsz, tgt_len, src_len = q.size(0), q.size(2), k.size(2)
        bias = multiplier = gaussian = window = local = None
        if self.has_head_masks:
            masks = offset_mask(self.mask_bounds, tgt_len, src_len, q.device)
            multiplier = masks.to(q.dtype).expand(bsz, -1, -1, -1)
        if self.localness is not None and self.localness.strategy == "layer":
            bias = self._add_localness(None, q, k, key_padding_mask)
        elif self.localness is not None:  # the bias goes into the attention's own call
            gaussian = self.localness.operator_inputs(
                _full_query(q), src_len, key_padding_mask, self.causal
            )
        if self.single_window:
            pointers = self.dynamic_windows[0]
            window = pointers.operator_inputs(
                query.transpose(0, 1), key_padding_mask, self.causal, window_keys["window0"]
            )
            if self.aw_covers_all_heads:
                local = mechanisms.LocalScoreInputs(
                    self.local_q_proj.weight, self.local_q_proj.bias, window_keys["local_key"],
                    self.scaling,
                )  # fmt: skip
            if gaussian is not None:  # the window's term joins the Gaussian layer's call
                if local is not None:
                    term, phi = mechanisms.additive_window_term(window, local)
                    bias = term if bias is None else bias + term
                else:
                    mask, phi = mechanisms.dynamic_window_mask(window)
                    multiplier = mask if multiplier is None else multiplier * mask
                pointers.keep_pointers(phi)
                window = None
        elif self.dynamic_windows:
            windows = self._window_masks(query, window_keys, key_padding_mask)
            if self.aw_covers_all_heads:
                local = self._local_window_scores(query, window_keys, windows)
                bias = local if bias is None else bias + local
            else:
                multiplier = windows if multiplier is None else multiplier * windows
        q, k = self._expand_groups(q), self._expand_groups(k)
        dropout_p = self._attention_dropout_p()
        shape = (bsz, self.num_heads, tgt_len, src_len)
        attention = mechanisms.AttentionInputs(
            self.plan.additive_mask(attn_mask, tgt_len, src_len, q.dtype, q.device),
            None if key_padding_mask is None else key_padding_mask.to(torch.bool),
            draw_dropout_keep(shape, dropout_p, q.device),
            self.scaling, dropout_p,
        )  # fmt: skip
        if gaussian is not None:  # the Gaussian bias and the attention in one call
            out, centre, widths = mechanisms.gaussian_attention(
                q, k, v, gaussian, bias, multiplier, attention
            )
            if self.record_localness:
                self.last_localness = (centre, widths)
            return out
        if window is not None:  # the window's mask (or AW's term) and the attention in one call
            out, phi = mechanisms.window_attention(
                q, k, v, window, local, bias, multiplier, attention
            )
            self.dynamic_windows[0].keep_pointers(phi)
            return out
        return mechanisms.dense_attention(q, k, v, bias, multiplier, attention)

    # -- local and band heads without a T x T matrix ------------------------------------------
    def _attention_dropout_p(self) -> float:
        module = self.dropout_module
        return module.p if self.training or module.apply_during_inference else 0.0

    def _band_windows(self, heads: Sequence[int]) -> Tuple[List[int], List[int]]:
        """(left, right) windows of the local heads in ``heads``, for the banded operator."""
        left = [-self.window_bounds[h].lo for h in heads]
        right = [0 if self.causal else self.window_bounds[h].hi for h in heads]
        return left, right

    def _banded_attention(self, q, k, v, key_padding_mask, heads=None):
        """Local heads (all, or those in ``heads``) through the banded operator."""
        heads = list(range(self.num_heads)) if heads is None else heads
        key = tuple(heads)
        windows = self._band_windows_by_heads.get(key)
        if windows is None:  # the same heads on every call: worked out once
            windows = self._band_windows_by_heads[key] = self._band_windows(heads)
        left, right = windows
        q, k = self._expand_groups(q), self._expand_groups(k)
        q, k, v = (self._select_heads(t, heads).contiguous() for t in (q, k, v))
        return banded_attention(
            q, k, v, left, right, key_padding_mask, self.scaling, self._attention_dropout_p()
        )

    def _band_heads_attention(self, q, k, v, key_padding_mask):
        """Pande's band heads: the band of the full softmax, from the banded operator and the
        log-sum-exp over all keys (computed once per Q/K group)."""
        padding = key_padding_mask.bool() if key_padding_mask is not None else None
        q_groups, k_groups = (self._select_heads(t, self.band_groups) for t in (q, k))
        group_lse = all_keys_logsumexp(q_groups, k_groups, self.scaling, padding, self.causal)
        lse = self._select_heads(group_lse, self.band_head_group)
        q, k = self._expand_groups(q), self._expand_groups(k)
        bands = [(self.mask_bounds[h].lo, self.mask_bounds[h].hi) for h in self.band_heads]
        return band_of_full_softmax(
            *(self._select_heads(t, self.band_heads) for t in (q, k, v)),
            bands, padding, self.scaling, self._attention_dropout_p(), self.causal, lse,
        )  # fmt: skip

    def _banded_path(self, q, k, v, query, window_keys, key_padding_mask, attn_mask):
        return self._banded_attention(q, k, v, key_padding_mask)

    def _attention_by_head_kind(self, q, k, v, query, window_keys, key_padding_mask, attn_mask):
        """Band heads, local heads and global heads of one layer, each on its own path."""
        parts, order = [], []
        if self.band_heads:
            parts.append(self._band_heads_attention(q, k, v, key_padding_mask))
            order += self.band_heads
        if self.local_heads:
            parts.append(self._banded_attention(q, k, v, key_padding_mask, self.local_heads))
            order += self.local_heads
        if self.global_heads:
            heads = self.global_heads
            q_heads, k_heads = self._expand_groups(q), self._expand_groups(k)
            selected = (self._select_heads(t, heads) for t in (q_heads, k_heads, v))
            parts.append(self._fused_attention(*selected, key_padding_mask, attn_mask))
            order += heads
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        if order == list(range(self.num_heads)):
            return out
        position = {head: i for i, head in enumerate(order)}
        back = torch.tensor([position[h] for h in range(self.num_heads)], device=out.device)
        return out.index_select(1, back)

    def _select_heads(self, x: Tensor, heads: Sequence[int]) -> Tensor:
        if len(heads) == x.size(1) and list(heads) == list(range(x.size(1))):
            return x
        key = (tuple(heads), x.device)
        index = self._head_index_cache.get(key)
        if index is None:  # the same few head lists on every call: one index tensor each
            index = torch.tensor(heads, device=x.device)
            if not torch.compiler.is_compiling():
                self._head_index_cache[key] = index
        return x.index_select(1, index)

    def _fused_path(self, q, k, v, query, window_keys, key_padding_mask, attn_mask):
        return self._fused_attention(q, k, v, key_padding_mask, attn_mask)

    def _fused_attention(self, q, k, v, key_padding_mask, attn_mask):
        """Global heads through ``scaled_dot_product_attention``, with the layer's causality."""
        tgt_len, src_len = q.size(2), k.size(2)
        dropout_p = self._attention_dropout_p()
        if self.plan.kernel_causal(attn_mask, key_padding_mask, tgt_len, src_len):
            # a whole causal sequence: no (T, T) mask to build or read
            return fused_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        mask = self.plan.additive_mask(attn_mask, tgt_len, src_len, q.dtype, q.device)
        if mask is not None:
            mask = mask[None, None]
        mask = _additive_mask(key_padding_mask, mask, q.dtype, q.device)
        out = fused_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        if mask is not None:
            # Queries whose keys are all masked: zeros, as in the explicit path.
            no_key = torch.isneginf(mask).all(dim=-1, keepdim=True)
            out = out.masked_fill(no_key, 0.0)
        return out

    def _expand_groups(self, x: Tensor) -> Tensor:
        """(bsz, groups, ...) -> (bsz, heads, ...): every head takes its Q/K group's values."""
        if self.groups_are_heads:
            return x
        if self.num_qk_groups == 1:
            return x.expand(-1, self.num_heads, *x.shape[2:])  # a view: no copy
        return x.index_select(1, self.head_to_group)

    def _merge_heads(self, out: Tensor, tgt_len: int, bsz: int) -> Tensor:
        """Concatenate the heads and project, each head's output gated (Voita et al.).

        A gate is one number per head for the whole batch, so gating a head's output equals
        scaling out_proj's columns that read it. Whichever is smaller is scaled: the (d, d)
        weight, or the outputs when the call has fewer tokens than d (a decoding step, a tiny
        batch) or when out_proj carries hooks of its own, which run only when it is called
        (analysis tools read its input: the gated outputs). In float32 at least: a gate's
        gradient sums over every token, beyond float16's range.
        """
        out = out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, self.num_heads * self.head_dim)
        proj = self.out_proj
        if self.head_gates is None:
            return proj(out)
        gates = self.head_gates().view(-1, 1)
        precise = torch.promote_types(proj.weight.dtype, torch.float32)
        hooks = (proj._forward_hooks, proj._forward_pre_hooks, proj._backward_hooks,
                 proj._backward_pre_hooks)  # fmt: skip
        if tgt_len * bsz < proj.weight.size(0) or any(hooks):
            heads = out.to(precise).view(tgt_len, bsz, self.num_heads, self.head_dim) * gates
            return proj(heads.view_as(out).to(out.dtype))
        columns = proj.weight.to(precise).view(-1, self.num_heads, self.head_dim) * gates
        return F.linear(out, columns.view_as(proj.weight).to(proj.weight.dtype), proj.bias)

    def _without_heads(self, query, key, need_weights, need_head_weights):
        """A layer whose heads were all pruned adds out_proj's bias to the residual, nothing
        else; its attention weights (asked for by alignment code) are zeros."""
        tgt_len, bsz, _ = query.size()
        out = self.out_proj(query.new_zeros(tgt_len, bsz, 0))
        if not need_weights:
            return out, None
        src_len = key.size(0) if key is not None else tgt_len
        shape = (0, bsz, tgt_len, src_len) if need_head_weights else (bsz, tgt_len, src_len)
        return out, query.new_zeros(shape)

    def extra_repr(self):
        heads = " ".join(s.token for s in self.head_specs)
        return f"layer={self.layer_index}, heads=[{heads}]"


def _additive_mask(key_padding_mask, mask, dtype, device) -> Optional[Tensor]:
    """An additive mask (1, 1, tgt, src) or None, and the key padding, as one additive mask of 0
    and -inf, (bsz or 1, 1, tgt or 1, src), or None when there is neither."""
    if key_padding_mask is not None:
        pad = torch.zeros(key_padding_mask.shape, dtype=dtype, device=device)
        pad = pad.masked_fill(key_padding_mask.to(torch.bool), float("-inf"))[:, None, None]
        mask = pad if mask is None else mask + pad
    return mask


def _full_query(q: Tensor) -> Tensor:
    """(bsz, groups, tgt, head_dim) -> (bsz, tgt, groups * head_dim): the whole query vector,
    which Yang et al.'s W_p reads."""
    return q.transpose(1, 2).flatten(2)


# The method computing each path other than the explicit one (the steps inside forward).
_PATH_METHODS = {
    Path.FUSED: "_fused_path",
    Path.GAUSSIAN_SDPA: "_gaussian_sdpa_attention",
    Path.BANDED: "_banded_path",
    Path.BY_HEAD_KIND: "_attention_by_head_kind",
    Path.TERMS_OPERATOR: "_attention_with_terms",
}
