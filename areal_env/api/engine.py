"""The inference engine protocol that the proxy and the trainer program against."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from areal_env.api.io import ModelRequest, ModelResponse, StreamChunk


class EngineUnavailableError(RuntimeError):
    """The engine cannot serve (down, destroyed, all servers unreachable). Proxy maps it to 503."""


class PromptTooLongError(ValueError):
    """Prompt (plus at least one new token) exceeds the model's context. Proxy maps it to 413."""


@runtime_checkable
class InferenceEngine(Protocol):
    """What every backend (embedded, SGLang HTTP, remote) provides.

    Invalid requests raise ``ValueError`` (``PromptTooLongError`` for context overflow) and
    never disturb other in-flight requests.
    """

    async def agenerate(self, req: ModelRequest) -> ModelResponse: ...

    def agenerate_stream(self, req: ModelRequest) -> AsyncIterator[StreamChunk]:
        """Yield tokens as they are produced; the last chunk has ``final`` set."""
        ...

    def update_weights(self, weights: dict[str, Any] | str) -> None:
        """Swap in new weights (a state dict, or a path to an HF folder) and bump the version."""
        ...

    def get_version(self) -> int: ...

    def set_version(self, version: int) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def initialize(self) -> None: ...

    def destroy(self) -> None: ...


async def stream_from_generate(engine: Any, req: ModelRequest) -> AsyncIterator[StreamChunk]:
    """Fallback streaming for engines that can only return whole completions."""
    resp = await engine.agenerate(req)
    yield StreamChunk(
        token_ids=list(resp.output_tokens),
        logprobs=list(resp.output_logprobs),
        versions=list(resp.output_versions),
        final=resp,
    )
