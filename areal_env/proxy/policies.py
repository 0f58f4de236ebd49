"""Routing by the request's ``model`` field: which policy (engine and tokenizer) answers.

A proxy without policies has one route and answers any model name with it (agents send
``gpt-4o``, ``default``, ...). A proxy for a multi-agent run (``policies:`` in the config) has
one route per policy, keyed by its name: a request naming anything else gets 404
``model_not_found``, in its protocol's error format, before any work is done.

Each route renders prompts and parses outputs with its own tokenizer. Policies that share a
tokenizer (every LoRA adapter on the base model, and full models with the same vocabulary and
chat template) share one renderer, so a session may hand its conversation from one policy to
another and the next prompt is still spliced onto the exact tokens already produced. A
conversation made by a policy whose tokenizer differs cannot be spliced: that request gets 400
``policy_tokenizer_mismatch`` (see :meth:`PolicyRoutes.check_continuation`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from areal_env.api.config import ProxyConfig
from areal_env.api.engine import InferenceEngine
from areal_env.http.errors import HTTPError
from areal_env.proxy.protocols.common import DEFAULT_TOOL_MARKERS, TokenTexts
from areal_env.proxy.render import ChatRenderer


@dataclass(frozen=True)
class PolicyEndpoint:
    """What serves one policy: its engine (an adapter of the base engine, or an engine of its
    own) and the tokenizer its prompts are rendered with."""

    engine: InferenceEngine
    tokenizer: Any


@dataclass
class PolicyRoute:
    """One policy as the pipeline uses it: engine, renderer, and the per-token helpers."""

    name: str | None
    """The policy's name; ``None`` for the one route of a proxy without policies."""
    engine: InferenceEngine
    tokenizer: Any
    renderer: ChatRenderer
    token_texts: TokenTexts
    skip_ids: frozenset[int]
    """Token ids never shown as text (the chat template's stop tokens, the engine's eos)."""
    tool_markers: tuple[str, ...]
    tokenizer_key: str
    """Equal for routes whose token ids mean the same (their conversations splice)."""
    extra: dict[str, Any] = field(default_factory=dict)


def tokenizer_key(tokenizer: Any) -> str:
    """A digest of what makes token ids mean the same text: the vocabulary, the special tokens
    and the chat template."""
    try:
        vocab = sorted(tokenizer.get_vocab().items())
    except (AttributeError, TypeError):
        vocab = []
    blob = json.dumps(
        [
            vocab,
            getattr(tokenizer, "chat_template", None),
            getattr(tokenizer, "all_special_tokens", None),
        ],
        default=str,
    )
    return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


def make_route(
    name: str | None,
    engine: InferenceEngine,
    tokenizer: Any,
    config: ProxyConfig,
    *,
    renderer: ChatRenderer | None = None,
    key: str | None = None,
) -> PolicyRoute:
    """A route for ``engine``, rendering with ``renderer`` (default: a new one on
    ``tokenizer`` with the proxy's tool parser)."""
    renderer = renderer or ChatRenderer(
        tokenizer, config.tool_parser, worked_example=config.worked_example
    )
    parser = renderer.parser
    marker = getattr(parser, "open_tag", None) or getattr(parser, "marker", None)
    return PolicyRoute(
        name=name,
        engine=engine,
        tokenizer=tokenizer,
        renderer=renderer,
        token_texts=TokenTexts(tokenizer),
        skip_ids=frozenset(renderer.stop_token_ids) | frozenset(engine.eos_token_ids),
        tool_markers=(marker,) if isinstance(marker, str) and marker else DEFAULT_TOOL_MARKERS,
        tokenizer_key=key if key is not None else tokenizer_key(tokenizer),
    )


class PolicyRoutes:
    """The routes of one proxy: ``default`` alone (no policies), or one per policy name."""

    def __init__(self, default: PolicyRoute, named: Mapping[str, PolicyRoute] | None = None):
        self.default = default
        self.named: dict[str, PolicyRoute] = dict(named or {})

    @classmethod
    def build(
        cls,
        default: PolicyRoute,
        policies: Mapping[str, PolicyEndpoint],
        config: ProxyConfig,
    ) -> PolicyRoutes:
        """Routes for ``policies``; those whose tokenizer is the default route's (or each
        other's) share its renderer."""
        renderers: dict[str, ChatRenderer] = {default.tokenizer_key: default.renderer}
        keys: dict[int, str] = {id(default.tokenizer): default.tokenizer_key}
        named = {}
        for name, endpoint in policies.items():
            tok = endpoint.tokenizer
            key = keys.get(id(tok))
            if key is None:
                key = keys[id(tok)] = tokenizer_key(tok)
            route = make_route(
                name, endpoint.engine, tok, config, renderer=renderers.get(key), key=key
            )
            renderers.setdefault(key, route.renderer)
            named[name] = route
        return cls(default, named)

    @property
    def names(self) -> list[str]:
        """The policy names served (empty: any model name is served by the default route)."""
        return list(self.named)

    def route(self, model: str | None) -> PolicyRoute:
        """The route of a request's ``model`` (404 ``model_not_found`` for an unknown policy)."""
        if not self.named:
            return self.default
        route = self.named.get(model) if model is not None else None
        if route is None:
            served = ", ".join(self.named)
            raise HTTPError(
                404,
                f"The model {model!r} does not exist: this proxy serves the policies {served}",
                param="model",
                code="model_not_found",
            )
        return route

    def of_policy(self, name: str | None) -> PolicyRoute:
        """The route that produced a recorded completion (``Interaction.policy``)."""
        return self.named.get(name, self.default) if name is not None else self.default

    def check_continuation(self, route: PolicyRoute, parent_policy: str | None) -> None:
        """400 when ``route`` would splice onto tokens made by a policy whose tokenizer differs
        (the ids would be read as other text)."""
        made_by = self.of_policy(parent_policy)
        if made_by.tokenizer_key != route.tokenizer_key:
            raise HTTPError(
                400,
                f"this conversation continues a completion of policy {made_by.name!r}, whose "
                f"tokenizer differs from policy {route.name!r}'s: its token ids cannot be "
                "spliced into this policy's prompt. Start a new conversation for this policy, "
                "or give both policies the same tokenizer",
                param="model",
                code="policy_tokenizer_mismatch",
            )
