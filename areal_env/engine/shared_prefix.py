"""Attention over a prompt prefix that every row of the batch shares, read once per step.

Why: agent traffic puts one long system prompt (instructions, tool schemas) in front of every
row. Each decode step used to read every row's own copy of its keys and values: at 32 rows
behind the demo's ~420-token prompt that is 620 MB of fp32 KV a step, and attention was 44 %
of a decode step (SmolLM2-135M, 2 CPU cores). With a :class:`SharedPrefix`, the batch's rows
hold only the columns that follow the prefix (``kv_cache.BatchKV``) and the prefix's keys and
values are held once. :func:`shared_prefix_attention` scores every row's queries against the
prefix in one matmul per layer (the prefix read once), against each row's own columns as
before, and takes one softmax over both: the same attention as over the concatenation (the
keys carry their positions already, so the order of the columns does not matter).

The prefix always comes before every row's own columns, so a causal mask over the rows' own
columns is all a query needs: every query sees the whole prefix.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

SHARED_PREFIX_ATTN = "areal_shared_prefix_sdpa"
"""The attention function registered with transformers (plain sdpa without a prefix)."""

MIN_SHARED_TOKENS = 32
"""The shortest prefix worth sharing: below it the rows keep their own copies."""


class SharedPrefix:
    """The keys/values ``kv`` ``[layers, 2, kv_heads, P, head_dim]`` of the ``P`` tokens that
    every row of a batch starts with, their prefix-cache key (``RequestState.prompt_key``'s
    first ``P`` entries: rows of different LoRA adapters never share a prefix) and the epoch of
    the weights they were computed under (``PrefixCache.epoch``: a row prefilled after a weight
    update must not attend to keys of the old weights).

    A plain class on purpose: it travels through the model's forward as a keyword argument to
    the attention function, untouched by anything that walks tensors in dataclasses."""

    def __init__(self, key: list[int], kv: torch.Tensor, epoch: int = 0) -> None:
        if kv.shape[3] != len(key):
            raise ValueError(f"a shared prefix of {len(key)} tokens holds {kv.shape[3]} columns")
        self.key = key
        self.kv = kv
        self.epoch = epoch

    @property
    def length(self) -> int:
        return len(self.key)

    def truncated(self, n: int) -> SharedPrefix:
        """The first ``n`` tokens of this prefix."""
        return SharedPrefix(self.key[:n], self.kv[:, :, :, :n].contiguous(), self.epoch)


def shared_prefix_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    prefix_key: torch.Tensor,
    prefix_value: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Attention of ``query`` ``[B, Hq, T, D]`` over a shared prefix (``prefix_key`` and
    ``prefix_value`` ``[Hkv, P, D]``, seen by every query) followed by each row's own ``key`` and
    ``value`` ``[B, Hkv, S, D]`` under ``attention_mask`` (``[B, 1, T, S]``: boolean, True =
    attend, or additive; None = attend to all). Returns ``[B, T, Hq, D]`` (transformers' layout
    after attention). Query head ``h`` reads key/value head ``h // (Hq / Hkv)`` (grouped-query
    attention, as ``repeat_kv`` orders them)."""
    B, Hq, T, D = query.shape
    Hkv, S, P = key.shape[1], key.shape[2], prefix_key.shape[1]
    group = Hq // Hkv
    q = (query * scaling).reshape(B, Hkv, group * T, D)  # a key head's query heads, stacked
    # against the prefix: all rows' queries in one matmul per key head, the prefix read once
    q_by_head = q.transpose(0, 1).reshape(Hkv, B * group * T, D)
    on_prefix = torch.matmul(q_by_head, prefix_key.transpose(1, 2))  # [Hkv, B*G*T, P]
    on_prefix = on_prefix.view(Hkv, B, group * T, P).transpose(0, 1)
    on_own = torch.matmul(q, key.transpose(2, 3))  # [B, Hkv, G*T, S]
    if attention_mask is not None:
        mask = attention_mask.expand(B, 1, T, S)
        mask = mask.unsqueeze(2).expand(B, 1, group, T, S).reshape(B, 1, group * T, S)
        if mask.dtype == torch.bool:
            on_own = on_own.masked_fill(~mask, float("-inf"))
        else:
            on_own = on_own + mask.to(on_own.dtype)
    weights = torch.softmax(torch.cat([on_prefix, on_own], dim=-1), dim=-1)
    w_prefix, w_own = weights[..., :P], weights[..., P:]
    w_by_head = w_prefix.transpose(0, 1).reshape(Hkv, B * group * T, P)
    out = torch.matmul(w_by_head, prefix_value).view(Hkv, B, group * T, D).transpose(0, 1)
    out = out + torch.matmul(w_own, value)  # [B, Hkv, G*T, D]
    return out.reshape(B, Hq, T, D).transpose(1, 2)


def supports_shared_prefix(model: torch.nn.Module) -> str | None:
    """Why ``model``'s attention cannot take a shared prefix (None when it can): only plain
    sdpa attention over every past position (no sliding window, no logit soft-capping)."""
    cfg: Any = getattr(model, "config", None)
    impl = getattr(cfg, "_attn_implementation", None)
    if impl not in ("sdpa", SHARED_PREFIX_ATTN):
        return f"attention implementation {impl!r} is not sdpa"
    if getattr(cfg, "use_sliding_window", False) or (
        getattr(cfg, "sliding_window", None) and "use_sliding_window" not in cfg.to_dict()
    ):
        return "the model attends through a sliding window"
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return f"layer types {sorted(set(layer_types))}"
    if getattr(cfg, "attn_logit_softcapping", None):
        return "attention logits are soft-capped"
    return None


UNSUPPORTED_ARGUMENTS = ("sliding_window", "softcap", "s_aux", "position_bias")
"""Attention arguments of some models that this function does not implement."""


def transformers_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kw: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function registered as :data:`SHARED_PREFIX_ATTN`: over
    ``kw["shared_prefix"]`` (a :class:`SharedPrefix`) and the rows' own columns when given,
    plain sdpa otherwise. A model that passes arguments this function does not implement
    (``UNSUPPORTED_ARGUMENTS``) is refused with a way out, never answered wrong."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    shared: SharedPrefix | None = kw.pop("shared_prefix", None)
    if shared is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kw
        )
    used = [name for name in UNSUPPORTED_ARGUMENTS if kw.get(name) is not None]
    if used:
        raise RuntimeError(
            f"shared-prefix attention does not implement {', '.join(used)}, which this model "
            "passes to its attention; set engine.share_prefixes: false"
        )
    layer = shared.kv[module.layer_idx]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    t, s = query.shape[2], key.shape[2]
    if attention_mask is None and t > 1:
        # transformers drops a causal mask without padding and relies on sdpa's is_causal;
        # here the rows' own columns end with the queries' (a prefill after the prefix)
        own = torch.arange(s, device=query.device)
        last = s - t + torch.arange(t, device=query.device)
        attention_mask = (own[None, :] <= last[:, None])[None, None]
    out = shared_prefix_attention(query, key, value, attention_mask, layer[0], layer[1], scale)
    return out, None


def enable_shared_prefix_attention(model: torch.nn.Module) -> bool:
    """Register :func:`transformers_attention` with transformers as :data:`SHARED_PREFIX_ATTN`
    and switch ``model`` to it. Returns False (and changes nothing) where
    :func:`supports_shared_prefix` says why not, or where the model refuses a custom attention
    function."""
    why = supports_shared_prefix(model)
    if why is not None:
        logger.info("shared-prefix attention off: %s", why)
        return False
    cfg: Any = model.config
    if cfg._attn_implementation == SHARED_PREFIX_ATTN:
        return True
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SHARED_PREFIX_ATTN, transformers_attention)
    AttentionMaskInterface.register(SHARED_PREFIX_ATTN, sdpa_mask)
    setter = getattr(model, "set_attn_implementation", None)
    try:
        if setter is not None:
            setter(SHARED_PREFIX_ATTN)
        else:
            cfg._attn_implementation = SHARED_PREFIX_ATTN
    except (ValueError, TypeError, NotImplementedError) as e:  # no custom attention here
        logger.info("shared-prefix attention off: %s", e)
        return False
    return cfg._attn_implementation == SHARED_PREFIX_ATTN
