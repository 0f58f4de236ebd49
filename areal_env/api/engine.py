"""The inference engine protocol that the proxy and the trainer program against."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, Protocol, runtime_checkable

from areal_env.api.io import ModelRequest, ModelResponse, StreamChunk


class EngineUnavailableError(RuntimeError):
    """The engine cannot serve (down, destroyed, all servers unreachable). Proxy maps it to 503."""


class PromptTooLongError(ValueError):
    """Prompt (plus at least one new token) exceeds the model's context. Proxy maps it to 413."""


@runtime_checkable
class InferenceEngine(Protocol):
    """What every backend (embedded, SGLang HTTP, remote, ``engine.testing.ScriptedEngine``)
    provides: everything callers use, so nobody probes with ``getattr``.

    Invalid requests raise ``ValueError`` (``PromptTooLongError`` for context overflow) and
    never disturb other in-flight requests.
    """

    @property
    def tokenizer(self) -> Any:
        """The HF tokenizer when the engine holds one in this process; ``None`` when its
        servers tokenize (SGLang): load one from ``model_path`` then."""
        ...

    @property
    def eos_token_ids(self) -> list[int]:
        """Token ids that end a completion (known after ``initialize``; may be empty)."""
        ...

    @property
    def max_context_len(self) -> int | None:
        """Prompt + completion tokens the engine accepts (``None``: not known yet)."""
        ...

    @property
    def model_path(self) -> str | None:
        """Where the weights came from (HF folder or model name)."""
        ...

    @property
    def supports_state_dict_update(self) -> bool:
        """``update_weights`` takes an in-memory state dict (else only an HF folder path)."""
        ...

    @property
    def supports_lora(self) -> bool:
        """``update_weights`` takes a LoRA adapter folder (merged onto the base weights)."""
        ...

    async def agenerate(self, req: ModelRequest) -> ModelResponse: ...

    def agenerate_stream(self, req: ModelRequest) -> AsyncGenerator[StreamChunk, None]:
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

    def stats(self) -> dict[str, float]:
        """Counters for ``/get_server_info`` and logs (may be empty)."""
        ...


async def stream_from_generate(
    engine: InferenceEngine, req: ModelRequest
) -> AsyncGenerator[StreamChunk, None]:
    """Streaming for engines that can only return whole completions: one chunk, the result."""
    resp = await engine.agenerate(req)
    yield StreamChunk(
        token_ids=list(resp.output_tokens),
        logprobs=list(resp.output_logprobs),
        versions=list(resp.output_versions),
        final=resp,
    )
