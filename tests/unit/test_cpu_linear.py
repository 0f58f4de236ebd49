"""oneDNN's fp32 linear kernel in the embedded engine (``engine.cpu_linear``)."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F

from areal_env.api.io import GenerationConfig, ModelRequest
from areal_env.engine.cpu_linear import OneDnnLinear, onednn_linear_unavailable, set_onednn_linears
from areal_env.engine.local import LocalEngine

pytestmark = pytest.mark.skipif(
    onednn_linear_unavailable() is not None, reason=str(onednn_linear_unavailable())
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (26, 64), (3, 7, 64), (500, 64)])
def test_product_is_the_fp32_product(bias, shape):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96, bias=bias)
    x = torch.randn(*shape)
    want = F.linear(x, layer.weight, layer.bias)
    assert set_onednn_linears(layer, True) == 1
    assert type(layer) is OneDnnLinear
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a non-contiguous input (a transposed view) gives the same product
    xt = x.reshape(-1, 64).t().contiguous().t()
    torch.testing.assert_close(layer(xt), F.linear(xt, layer.weight, layer.bias))


def test_other_dtypes_keep_pytorchs_product():
    layer = torch.nn.Linear(64, 32).to(torch.bfloat16)
    set_onednn_linears(layer, True)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_switch_keeps_parameters_hooks_and_reads_updated_weights():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    weight = model[2].weight
    model[2].register_forward_hook(lambda mod, args, out: out + 100.0)
    assert set_onednn_linears(model, True) == 2
    assert model[2].weight is weight  # the same parameter, not a copy
    x = torch.randn(3, 8)
    out = model(x)
    assert (out > 50).all()  # the hook still runs (LoRA adapters are served through hooks)
    with torch.no_grad():
        weight.zero_()
        model[2].bias.zero_()
    torch.testing.assert_close(model(x), torch.full((3, 4), 100.0))  # new weights, read at once
    assert set_onednn_linears(model, False) == 2
    assert all(type(m) is torch.nn.Linear for m in (model[0], model[2]))


def test_engine_answers_alike_with_either_kernel(engine, tokenizer, model_path):
    """The shared engine (fp32 CPU) runs oneDNN's kernel; one with ``onednn_linear=False`` runs
    PyTorch's. Greedy answers agree, and their logprobs to fp32 rounding."""
    linears = [m for m in engine.worker.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is OneDnnLinear for m in linears)
    plain = LocalEngine(model_path, max_batch_size=8, onednn_linear=False)
    plain.initialize()
    try:
        assert not any(type(m) is OneDnnLinear for m in plain.worker.model.modules())
        prompts = ["What is 2+2?", "Name three colours.", "Write a sentence about the sea."]

        async def answers(eng: LocalEngine):
            reqs = [
                ModelRequest(
                    input_ids=list(
                        tokenizer.apply_chat_template(
                            [{"role": "user", "content": p}],
                            add_generation_prompt=True,
                            tokenize=True,
                            return_dict=False,
                        )
                    ),
                    gconfig=GenerationConfig(max_new_tokens=16, greedy=True),
                )
                for p in prompts
            ]
            return await asyncio.gather(*(eng.agenerate(r) for r in reqs))

        fast, slow = asyncio.run(answers(engine)), asyncio.run(answers(plain))
        for a, b in zip(fast, slow, strict=True):
            assert a.output_tokens == b.output_tokens
            torch.testing.assert_close(
                torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-3, rtol=0
            )
    finally:
        plain.destroy()
