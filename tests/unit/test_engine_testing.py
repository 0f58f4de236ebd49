"""``ScriptedEngine`` keeps the InferenceEngine contract (no model, no tokenizer needed)."""

from __future__ import annotations

import pytest

from areal_env.api.engine import EngineUnavailableError, InferenceEngine, PromptTooLongError
from areal_env.api.io import GenerationConfig, ModelRequest
from areal_env.engine.testing import Reply, ScriptedEngine


def _req(n_prompt: int = 3, max_new: int = 16) -> ModelRequest:
    return ModelRequest(list(range(n_prompt)), GenerationConfig(max_new_tokens=max_new))


async def test_script_then_default_and_recorded_requests():
    eng = ScriptedEngine(
        script=[[5, 6, 7], Reply(token_ids=[9], logprobs=[-1.0], version=3, stop_reason="length")],
        default=lambda req: [len(req.input_ids)],
        eos_token_ids=[2],
    )
    assert isinstance(eng, InferenceEngine)
    a = await eng.agenerate(_req())
    assert a.output_tokens == [5, 6, 7] and a.output_logprobs == [-0.5] * 3
    b = await eng.agenerate(_req())
    assert (b.output_tokens, b.output_versions, b.stop_reason) == ([9], [3], "length")
    c = await eng.agenerate(_req(n_prompt=4))
    assert c.output_tokens == [4] and eng.pending == 0 and len(eng.requests) == 3


async def test_truncation_stream_versions_and_failures():
    eng = ScriptedEngine(eos_token_ids=[2], max_context_len=10, stream_chunk_tokens=2)
    eng.push(Reply(token_ids=[1, 1, 1, 1, 1]))
    r = await eng.agenerate(_req(max_new=3))
    assert r.output_tokens == [1, 1, 1] and r.stop_reason == "length"
    eng.update_weights("/some/folder")
    eng.push(Reply(token_ids=[4, 5, 6]))
    chunks = [c async for c in eng.agenerate_stream(_req())]
    assert [c.token_ids for c in chunks] == [[4, 5], [6, 2]]  # eos appended on "stop"
    assert chunks[-1].final is not None and chunks[-1].final.output_versions == [1] * 4
    assert eng.weight_updates == ["/some/folder"] and eng.get_version() == 1
    with pytest.raises(PromptTooLongError):
        await eng.agenerate(_req(n_prompt=10))
    eng.push(ValueError("scripted failure"))
    with pytest.raises(ValueError, match="scripted failure"):
        await eng.agenerate(_req())
    eng.destroy()
    with pytest.raises(EngineUnavailableError):
        await eng.agenerate(_req())


def test_text_reply_needs_a_tokenizer():
    eng = ScriptedEngine(default="hi")
    with pytest.raises(ValueError, match="tokenizer"):
        eng._response(_req(), eng._next(_req()))
