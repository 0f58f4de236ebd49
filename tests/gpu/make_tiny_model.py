"""Write a small random Llama (with a real tokenizer) as a Hugging Face folder.

    python -m tests.gpu.make_tiny_model TOKENIZER_FOLDER OUT_FOLDER [--like CONFIG_JSON]

For GPU machines that cannot fetch the default model: the CUDA tests check code paths (devices,
dtypes, attention, weight pushes, NCCL), not what a model knows, so random weights of the real
architecture do. The tokenizer folder is small enough to carry (the converted default model's
``tokenizer*.json`` and ``chat_template.jinja``). ``--like`` takes a real model's
``config.json`` instead: its full architecture with random weights, for GPU throughput figures
(speed does not depend on the weights' values).
"""

from __future__ import annotations

import shutil
from pathlib import Path


def make_tiny_model(
    tokenizer_dir: str,
    out_dir: str,
    *,
    seed: int = 0,
    like: str | None = None,
    device: str = "cpu",
    dtype: str | None = None,
) -> Path:
    """``device``: where the random weights are drawn (a GPU draws a 7B model in seconds, the
    CPU in minutes); ``dtype``: the dtype they are written in (e.g. bfloat16: half the disk)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    if like is not None:
        cfg = AutoConfig.from_pretrained(like)
    else:
        cfg = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    torch.manual_seed(seed)
    kwargs = {"dtype": getattr(torch, dtype)} if dtype else {}
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, **kwargs)
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tokenizer_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--like", default=None, help="a config.json (or folder): that architecture")
    args = ap.parse_args()
    print(make_tiny_model(args.tokenizer_dir, args.out_dir, like=args.like))
