"""Dataclass configuration, loaded from YAML with dotted command-line overrides.

``load_config(ExperimentConfig, "cfg.yaml", ["rollout.n_samples=8"])`` builds the nested dataclasses,
converts and validates every value, and raises ``ConfigError`` naming the bad key and value (an
unknown key lists the valid ones). Each section owns its ``validate()``. This module holds the
sections and ``load_config``; the loader's machinery (type conversion, overrides) is
``config_load``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from areal_env.api.config_load import (
    check_config_paths,
    config_from_dict,
    path_field,
    read_config_data,
)
from areal_env.api.errors import ConfigError, check_port, check_rate_limit
from areal_env.api.io import GenerationConfig
from areal_env.api.service_config import ServiceConfig

T = TypeVar("T")

_POLICY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------

WORKFLOW_KWARGS_PATHS: dict[str, Any] = {
    "reward_fn": "import",
    "mcp_config.command": "command",
    "mcp_config.cwd": "workdir",
    "aenv_config.server_python": "command",
}
"""Paths inside ``workflow_kwargs`` (the options of ``AenvAgent`` and the ready agents): a
``reward_fn`` file, an MCP server's command and working folder (a stdio server starts in the
config file's folder unless ``cwd`` says otherwise), the aenvironment servers' interpreter."""


DTYPES = ("auto", "float32", "bfloat16", "float16")
"""The dtype names ``model.dtype`` and ``engine.dtype`` take."""


@dataclass
class ModelConfig:
    """Which model to load and how."""

    path: str = path_field("model", default="smollm2-135m-instruct")
    """A known model name (see ``areal_env.engine.models``) or a local HF folder."""
    dtype: str = "auto"
    """The compute dtype: auto (fp32 on CPU, where a bf16-autocast update is only 1.15x faster,
    1.3x with AMX: ``bench/train_step.py --case dtype``; bf16 on GPU) | float32 | bfloat16 |
    float16. The trainer computes in it (autocast, or FSDP2's mixed-precision policy) over fp32
    master weights and optimizer states. The inference engine serves in ``engine.dtype``, which
    follows this one unless set."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N."""
    cache_dir: str | None = path_field("dir", default=None)
    """Where converted models live (default: $AREAL_ENV_CACHE or ~/.cache/areal_env)."""
    max_context_len: int | None = None
    """Cap on prompt + completion tokens (default: the model's own limit)."""
    gradient_checkpointing: bool = True
    """Recompute activations in the backward pass (less memory, ~30% slower)."""
    checkpointed_layer_share: float = 1.0
    """With ``gradient_checkpointing``: the share of decoder layers recomputed, spread evenly
    (0.5 = every other layer). Memory of activations and the recompute's time both scale with
    it: a middle value trades them where all layers' activations do not fit but some do."""
    num_threads: int | None = None
    """torch intra-op threads on CPU (default: torch's choice)."""

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype={self.dtype!r} is invalid; valid: {', '.join(DTYPES)}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(
                f"model.device={self.device!r} is invalid; valid: auto, cpu, cuda[:N]"
            )
        if self.max_context_len is not None and self.max_context_len < 2:
            raise ConfigError(f"model.max_context_len={self.max_context_len!r} must be >= 2")
        if not 0.0 < self.checkpointed_layer_share <= 1.0:
            raise ConfigError(
                f"model.checkpointed_layer_share={self.checkpointed_layer_share!r} must be in "
                "(0, 1]; to recompute no layer set model.gradient_checkpointing=false"
            )


@dataclass
class SGLangConfig:
    """How to launch (or reach) SGLang servers when ``engine.backend`` is ``sglang``."""

    addresses: list[str] = field(default_factory=list)
    """Already-running servers (host:port). Empty = launch ``num_servers`` ourselves."""
    num_servers: int = 1
    """Data-parallel SGLang servers to launch."""
    tp_size: int = 1
    """GPUs (tensor parallel) per server."""
    base_port: int = 30000
    """Server i listens on a free port at or above base_port + 10*i."""
    host: str = "127.0.0.1"
    """Address the launched servers bind."""
    mem_fraction_static: float | None = None
    """Passed to sglang.launch_server (--mem-fraction-static)."""
    extra_args: list[str] = field(default_factory=list)
    """Extra command-line arguments for sglang.launch_server, verbatim."""
    log_dir: str | None = path_field("dir", default=None)
    """Server log folder (default: run_dir/logs/servers)."""
    startup_timeout: float = 600.0
    """Seconds to wait for a launched server to become healthy."""
    launch_command: list[str] = field(default_factory=list)
    """Replaces ``python -m sglang.launch_server`` (e.g. ``[areal-env, serve]`` on a CPU box)."""
    weight_sync: Literal["disk", "nccl"] = "disk"
    """disk = one HF folder written per step, every server loads it (/update_weights_from_disk);
    nccl = rank 0 broadcasts the tensors over a process group shared with the servers
    (SGLang's init_weights_update_group + update_weights_from_distributed; GPUs only)."""
    weight_sync_port: int = 29650
    """With weight_sync nccl: the port of the weight-update group's store on rank 0's host."""

    def validate(self) -> None:
        if self.num_servers < 1:
            raise ConfigError(f"engine.sglang.num_servers={self.num_servers!r} must be >= 1")
        if self.tp_size < 1:
            raise ConfigError(f"engine.sglang.tp_size={self.tp_size!r} must be >= 1")


@dataclass
class EngineConfig:
    """The inference backend."""

    backend: Literal["local", "sglang", "remote"] = "local"
    """local = embedded transformers engine; sglang = launch/reach SGLang servers;
    remote = reach ``areal-env serve`` (or SGLang) servers listed in ``addresses``."""
    addresses: list[str] = field(default_factory=list)
    """host:port of inference servers for backend=remote."""
    dtype: str = "auto"
    """What the inference engine serves in, and so the dtype of the weights pushed to it:
    auto (= ``model.dtype``, the trainer's compute dtype) | float32 | bfloat16 | float16. Set
    it apart where the two should differ: on CPU, ``model.dtype: bfloat16`` with
    ``engine.dtype: float32`` trains under bf16 autocast (1.3x faster with AMX) while generation
    stays fp32, which is faster there than bf16 and keeps the base model's greedy answers.
    The embedded engine loads the model in it; SGLang gets it as ``--dtype``."""
    max_batch_size: int = 32
    """Local engine: most sequences decoded together."""
    prefix_cache_mb: float = 256
    """Local engine: memory (MiB) for the KV of shared prompt prefixes reused across requests
    (radix cache, LRU-evicted, cleared on weight updates); 0 = off."""
    share_prefixes: bool = True
    """Local engine: hold the prompt prefix that all running sequences start with (an agent's
    system prompt and tool schemas) once, so a decode step reads its keys/values once instead of
    once per sequence (models with plain sdpa attention; others keep a copy per sequence)."""
    cpu_linear: Literal["onednn", "default"] = "onednn"
    """Local engine on a CPU in fp32: the kernel of the linear layers' products. ``onednn``
    (oneDNN's fp32 kernel) made the demo's decode steps 1.25x and an evaluation 1.2x faster than
    ``default`` (PyTorch's, MKL's sgemm) on a 2-core AMD EPYC, with fp32 arithmetic either way
    (``bench/engine_throughput.py --case linear``); other devices and dtypes keep PyTorch's."""
    request_timeout: float = 3600.0
    """Seconds one generation request may take."""
    max_retries: int = 3
    """Retries after the first attempt of a failed HTTP request to an inference server."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)

    def served_dtype(self, model: ModelConfig) -> str:
        """``dtype`` with ``auto`` resolved to ``model.dtype`` (which may itself be auto: the
        device's default)."""
        return model.dtype if self.dtype == "auto" else self.dtype

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(
                f"engine.dtype={self.dtype!r} is invalid; valid: {', '.join(DTYPES)} (auto "
                "follows model.dtype)"
            )
        if self.max_batch_size < 1:
            raise ConfigError(f"engine.max_batch_size={self.max_batch_size!r} must be >= 1")
        if self.prefix_cache_mb < 0:
            raise ConfigError(
                f"engine.prefix_cache_mb={self.prefix_cache_mb!r} must be >= 0 (0 = off)"
            )
        if self.backend == "remote" and not self.addresses:
            raise ConfigError("engine.backend=remote needs engine.addresses (host:port list)")
        if self.max_retries < 0:
            raise ConfigError(f"engine.max_retries={self.max_retries!r} must be >= 0")


@dataclass
class ProxyConfig:
    """The interception proxy."""

    host: str = "127.0.0.1"
    """Bind address (a non-loopback address needs an explicit admin key)."""
    port: int = 0
    """0 = pick a free port."""
    admin_key: str | None = None
    """None = generate a random one at start."""
    session_ttl: float = 3600.0
    """Seconds an idle session lives."""
    max_sessions: int = 1024
    """Most sessions open at once."""
    max_interactions_per_session: int = 512
    """Most completions one session may record."""
    max_tokens_per_session: int = 262144
    """Most tokens (prompt + output, all completions) one session may record."""
    tool_parser: str = "auto"
    """auto | hermes | qwen | llama3 | mistral | none."""
    default_max_tokens: int = 512
    """Completion length when a request gives no max_tokens."""
    model_name: str | None = None
    """Name reported by /v1/models (default: model.path)."""
    initial_capacity: int | None = None
    """Sessions that may start before any /grant_capacity; None = unlimited (no capacity control)."""
    sampling: Literal["trainer", "agent"] = "trainer"
    """Who sets the sampling parameters of recorded completions. trainer = the experiment's
    ``gconfig`` (temperature, top_p, top_k) replaces what the agent sends, and the agent's
    max_tokens is capped at ``gconfig.max_new_tokens`` (logprobs are recomputed at the same
    temperature); agent = the agent's own parameters are used and recorded per completion, and
    the trainer recomputes each row at its own temperature. Evaluation sessions are greedy in
    both modes. A proxy without a trainer (``areal-env proxy``) has no gconfig: agent params."""
    constrain_required: bool = True
    """``tool_choice: required`` (with a prompt-formatted tool call, e.g. hermes): constrain the
    start of the call to an offered tool's name and its first argument key, as OpenAI's API and
    vLLM/SGLang's guided decoding guarantee a call of an offered tool. The rest of the call is
    free. Needs the embedded engine (SGLang servers ignore the constraint)."""
    worked_example: bool = False
    """For chat templates that ignore tools: also inject one worked example exchange (a request
    and a call of the first offered tool, placeholder arguments) after the system prompt. Weak
    tool callers (SmolLM2-135M) follow the call format far more often with it, but the example
    can solve the task for them, so it is off by default."""
    rate_limit_rps: float | None = None
    """Requests per second each session key may make to the model routes (chat completions,
    Responses, Anthropic messages, count_tokens); a token bucket, refilled at this rate. Past it
    the proxy answers 429 in the protocol's own error format with ``Retry-After``. None = no
    limit (the default: the trainer's capacity control already bounds its own agents)."""
    rate_limit_burst: int | None = None
    """Requests a session key may send at once before the rate applies (the bucket's size).
    None = ``max(1, ceil(rate_limit_rps))``, one second's worth."""

    def validate(self) -> None:
        check_port("proxy", self.port)
        if self.session_ttl <= 0:
            raise ConfigError(f"proxy.session_ttl={self.session_ttl!r} must be > 0")
        for name in ("max_sessions", "max_interactions_per_session", "max_tokens_per_session"):
            if getattr(self, name) < 1:
                raise ConfigError(f"proxy.{name}={getattr(self, name)!r} must be >= 1")
        self.rate_limit()

    def rate_limit(self) -> tuple[float, int] | None:
        """``(requests per second, burst)`` per session key, or None when unlimited
        (``ConfigError`` for bad values)."""
        return check_rate_limit(
            "proxy",
            "rate_limit_rps",
            self.rate_limit_rps,
            "rate_limit_burst",
            self.rate_limit_burst,
        )


@dataclass
class RolloutConfig:
    """How episodes are run and exported."""

    n_samples: int = 4
    """Samples per prompt (GRPO group size)."""
    batch_size: int = 4
    """Prompts per training step."""
    max_concurrent_rollouts: int = 16
    """Most episodes running at once."""
    max_head_offpolicyness: int = 0
    """No rollout starts on weights more than this many versions behind the trainer."""
    mode: Literal["inline", "subproc"] = "inline"
    """inline = await agent.run in the trainer's loop; subproc = worker processes (env vars)."""
    episode_timeout: float = 600.0
    """Seconds an episode may run before it is cancelled and rejected."""
    discount: float = 1.0
    """Reward discount per turn along the conversation tree."""
    export_style: Literal["individual", "concat"] = "individual"
    """individual = one row per completion; concat = one row per leaf path."""
    dump_to_file: bool = True
    """Write trajectory dumps to run_dir/rollout/{version}/{task_id}.jsonl and each update's
    per-token record to run_dir/tokens/ (what ``areal-env view`` shows; docs/viewer.md)."""
    prompt_sampling: Literal["shuffle", "signal"] = "shuffle"
    """How each step's prompts are drawn from ``train_dataset``. shuffle: every epoch in a
    shuffled order. signal: by the groups of items that ``signal_key`` names, each group's share
    in proportion to the variance of its recent rewards (p(1 - p) for 0/1 rewards), so the
    steps spend their episodes where the rewards vary and the update has something to learn
    (docs/training.md, "Drawing the prompts where the signal is")."""
    signal_key: str | None = None
    """With ``prompt_sampling: signal``: the dataset field that groups the items (a kind, a
    level)."""
    signal_floor: float = 0.25
    """With ``prompt_sampling: signal``: the least weight of a group, as a share of the largest
    group's, so that unsolved and mastered groups are still visited."""
    guide_key: str | None = None
    """The dataset field that holds an item's reference solution: its tool calls
    ``{"name", "arguments"}`` in order, optionally ending with the answer ``{"content"}``, for
    guided episodes (``guided_samples``)."""
    guided_samples: int = 0
    """How many of each group's ``n_samples`` training episodes are guided: their sampled
    replies start with the reference solution's next step (written by the engine, trained with
    the model's own logprobs, marked explored) while their calls follow it; past it the model
    replies alone. For steps the policy almost never samples, such as a tool chain's second
    call (docs/training.md, "Guided episodes"). 0 = off; evaluation is never guided; engines
    that cannot constrain (SGLang servers) sample guided replies freely."""

    def validate(self) -> None:
        for name in ("n_samples", "batch_size", "max_concurrent_rollouts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rollout.{name}={getattr(self, name)!r} must be >= 1")
        if self.max_head_offpolicyness < 0:
            raise ConfigError(
                f"rollout.max_head_offpolicyness={self.max_head_offpolicyness!r} must be >= 0"
            )
        if not (0.0 <= self.discount <= 1.0):
            raise ConfigError(f"rollout.discount={self.discount!r} must be in [0, 1]")
        if self.episode_timeout <= 0:
            raise ConfigError(f"rollout.episode_timeout={self.episode_timeout!r} must be > 0")
        if self.prompt_sampling not in ("shuffle", "signal"):
            raise ConfigError(
                f"rollout.prompt_sampling={self.prompt_sampling!r} is invalid; valid: shuffle, "
                "signal"
            )
        if self.prompt_sampling == "signal" and not self.signal_key:
            raise ConfigError(
                "rollout.prompt_sampling=signal needs rollout.signal_key: the dataset field "
                "that groups the items (a kind, a level)"
            )
        if not 0.0 < self.signal_floor <= 1.0:
            raise ConfigError(f"rollout.signal_floor={self.signal_floor!r} must be in (0, 1]")
        if isinstance(self.guided_samples, bool) or not isinstance(self.guided_samples, int):
            raise ConfigError(
                f"rollout.guided_samples={self.guided_samples!r} must be an integer >= 0"
            )
        if not 0 <= self.guided_samples < self.n_samples:
            raise ConfigError(
                f"rollout.guided_samples={self.guided_samples!r} must be in [0, n_samples) = "
                f"[0, {self.n_samples}): each group keeps at least one episode of the policy's "
                "own to compare the guided ones with"
            )
        if self.guided_samples and not self.guide_key:
            raise ConfigError(
                "rollout.guided_samples needs rollout.guide_key: the dataset field that holds "
                'each item\'s reference solution, [{"name": ..., "arguments": {...}}, ..., {"content": ...}]'
            )


@dataclass
class LoraConfig:
    """LoRA adapters (``peft``): only the adapter weights are trained, saved and pushed."""

    r: int = 16
    """Adapter rank."""
    alpha: int = 32
    """Scaling numerator (the update is scaled by alpha / r)."""
    dropout: float = 0.0
    """Dropout on the adapter input."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    """Module names to adapt (e.g. add gate_proj, up_proj, down_proj for the MLP)."""

    def validate(self) -> None:
        if self.r < 1:
            raise ConfigError(f"actor.lora.r={self.r!r} must be >= 1")
        if self.alpha <= 0:
            raise ConfigError(f"actor.lora.alpha={self.alpha!r} must be > 0")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"actor.lora.dropout={self.dropout!r} must be in [0, 1)")
        if not self.target_modules:
            raise ConfigError("actor.lora.target_modules is empty; e.g. [q_proj, v_proj]")


@dataclass
class PolicyConfig:
    """One trainable policy of a multi-agent run (an entry of ``policies:``).

    The proxy serves it under its name (the ``model`` field of a request picks it); the trainer
    updates it on the completions it produced and pushes only its weights. Optimiser fields left
    at ``None`` take the ``actor`` section's value.
    """

    model: str | None = path_field("model", default=None)
    """None (the default): a LoRA adapter on the run's base model (``model.path``), served by
    the same engine as the other adapters, in the same batches. A known model name or an HF
    folder: a full model of its own (full fine-tuning, its own engine and weights)."""
    lora: LoraConfig | None = None
    """The adapter's shape (default: ``actor.lora``, else LoRA's defaults). Adapter policies
    only."""
    lr: float | None = None
    """AdamW learning rate (default: ``actor.lr``)."""
    lr_warmup_steps: int | None = None
    """Learning-rate warmup (default: ``actor.lr_warmup_steps``)."""
    weight_decay: float | None = None
    """AdamW weight decay (default: ``actor.weight_decay``)."""
    adam_betas: list[float] | None = None
    """AdamW betas (default: ``actor.adam_betas``)."""
    adam_eps: float | None = None
    """AdamW epsilon (default: ``actor.adam_eps``)."""
    max_grad_norm: float | None = None
    """Gradient clipping norm (default: ``actor.max_grad_norm``)."""
    addresses: list[str] = field(default_factory=list)
    """A full-model policy with ``engine.backend: remote``: its own servers (host:port)."""

    @property
    def is_adapter(self) -> bool:
        """A LoRA adapter on the base model (else a full model of its own)."""
        return self.model is None

    def optimiser_overrides(self) -> dict[str, Any]:
        """The ``actor`` fields this policy sets for itself."""
        names = (
            "lr",
            "lr_warmup_steps",
            "weight_decay",
            "adam_betas",
            "adam_eps",
            "max_grad_norm",
        )
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


@dataclass
class ActorConfig:
    """The PPO update."""

    strategy: Literal["single", "fsdp"] = "single"
    """single = one process holds the whole model; fsdp = FSDP2 sharding over the torchrun
    ranks (gloo on CPU, NCCL on GPU; run under torchrun: see docs/scaling.md)."""
    fsdp_cpu_offload: bool = False
    """With strategy fsdp: keep sharded parameters, gradients and optimizer states in host
    memory; the optimizer steps on the CPU. A 7B full fine-tune then needs ~10 GB of GPU memory
    instead of ~127 GB, so it fits one 80 GB GPU (computed: docs/scaling.md); slower steps."""
    lora: LoraConfig | None = None
    """LoRA adapters, e.g. {r: 16, alpha: 32}; None = full fine-tuning."""

    frozen_layers: int = 0
    """Train only the decoder layers above the lowest ``frozen_layers`` (0 = all layers train).
    The frozen layers and the input embeddings' lookup get no gradient, so the update runs
    their forward once, with no recompute and no backward, and keeps no optimiser state for
    them: freezing the lower two thirds cuts a full fine-tune's update to about half its
    time (``bench/train_step.py --case frozen``). Fewer trained parameters move the model
    less per step: the demo (``config_chains.yaml``) freezes 15 of its 30 layers at twice a
    full fine-tune's ``lr`` and learns as many tool chains as with every layer trained (at
    the full fine-tune's rate, fewer; docs/training.md). With tied embeddings the shared
    matrix still trains as the output head. With ``lora``, adapters in the frozen layers stay
    at their initial (zero) update."""

    lr: float = 1e-5
    """AdamW learning rate."""
    lr_warmup_steps: int = 0
    """Optimiser steps over which the learning rate rises linearly to ``lr`` (0 = none). AdamW's
    first steps move nearly every weight by about ``lr``, whatever its gradient's size: with few
    right answers in the first batch that one step can break a small model's output format
    (measured: approx KL 0.23 in one update, held-out 20 % -> 0 %)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    adam_eps: float = 1e-8
    """AdamW epsilon, added to the root of the second moment. Where a parameter's gradients are
    much smaller than it, the step is the gradient times lr/eps (SGD-like) instead of lr times
    its sign; at 1e-8 nearly every parameter takes a full lr-sized step from the first update
    on, whatever its gradient's size."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    eps_clip: float = 0.2
    """PPO clip range (lower, and upper unless eps_clip_high is set)."""
    eps_clip_high: float | None = None
    """Upper clip range (asymmetric clipping); None = eps_clip."""
    ppo_n_minibatches: int = 2
    """Minibatches (optimizer steps) per PPO epoch."""
    minibatch_by_group: bool = True
    """Keep each group's rows (``group_ids``: one prompt's samples) in one minibatch, the groups
    shuffled and dealt to the minibatch with the fewest tokens so far. A group's rows share the
    prompt and often the first turns, which tree training then computes once instead of once
    per minibatch (5-8 % fewer computed tokens on the demo's batches); off = rows dealt at
    random, a group split across minibatches. Without group ids, or with fewer groups than
    minibatches, rows are dealt at random either way."""
    ppo_epochs: int = 1
    """Passes over each batch."""
    group_adv_norm: bool = True
    """Subtract the group mean."""
    group_std_norm: bool = True
    """Divide by the group std (GRPO); off = Dr.GRPO-style mean-only."""
    batch_adv_norm: bool = False
    """Normalise advantages over the whole batch as well."""
    punish_failed_exploration: bool = False
    """Keep the negative advantage of a failed episode whose tool was picked by
    ``gconfig.choice_exploration`` (rows with ``explored``). Off by default: the pick was not the
    policy's, and pushing a token the model finds unlikely down moves its probability mostly to
    the model's favourite, so every failed exploration taught "call the usual tool" (measured:
    runs collapsed onto ``add``). Paying explorations are always trained on."""
    weight_negatives_by_prob: bool = False
    """Scale each negative token advantage by the probability the token was sampled with: a
    failed likely token is pushed down fully, a failed rare pick barely (its pushed-off
    probability would go mostly to the model's favourite choice). Positive advantages unchanged."""
    guided_nll_coef: float = 0.0
    """Imitate guided episodes (``rollout.guided_samples``): their guide-written tokens with a
    positive advantage (a reference step in an episode that paid) are trained by
    ``guided_nll_coef`` times their negative log-likelihood instead of the PPO surrogate; the KL
    term still applies to them. Such a token is a verified demonstration: its push no longer
    depends on how the batch's other episodes set the advantage baseline, and no clip stops it
    within an update (docs/training.md, "Imitating guided steps", has what it did on the demo).
    0 = off: guided tokens take the PPO surrogate like the model's own."""
    reward_scaling: float = 1.0
    """Rewards are (r + reward_bias) * reward_scaling, then clipped."""
    reward_bias: float = 0.0
    """Added to every reward before scaling."""
    reward_clip: float = 20.0
    """Rewards are clipped to [-reward_clip, reward_clip]."""
    kl_coef: float = 0.0
    """KL to the reference (initial) model; 0 = no reference model is kept."""
    kl_estimator: Literal["k2", "k3"] = "k2"
    """The per-token KL term with ``d = logp - ref_logp``: ``k2`` = d²/2, whose gradient
    ``d`` is the reverse KL's on-policy and grows linearly; ``k3`` = exp(-d) + d - 1 (GRPO's),
    whose gradient ``1 - exp(-d)`` explodes once a token falls far below the reference:
    measured on the demo, a few JSON braces 15-18 nats down made the update's mean ``k3``
    9,380 and its gradient norm 270,000 before clipping, so the step went into those tokens."""
    ref_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The reference model's dtype (``kl_coef > 0``): ``auto`` = the compute dtype
    (``model.dtype``). The reference is frozen, so a low-precision copy loses nothing to
    rounded updates; it halves the copy's memory and, on a 2-core CPU with avx512_bf16, runs
    its forward 1.45x as fast as fp32 (``bench/train_step.py --case reference``). Its logprobs
    are bf16's rounding away from fp32's (0.03 nats per token on average, 0.28 at the 99th
    percentile, on the demo model's own text at T=0.5), which the KL term sees as a small pull."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (0 = entropy only logged)."""
    high_entropy_token_share: float = 1.0
    """Train only this share of each forward's scored tokens: those where the policy's entropy
    is highest (the forks: which tool, which number), as in "Beyond the 80/20 rule" (Wang et
    al., 2025). The others (a JSON brace the model is 99 % sure of) get no policy gradient:
    their advantage is the episode's, noise for a token no choice was made at, and Adam turns
    that small but coherent gradient into full-size steps. 1.0 = every scored token."""
    use_decoupled_loss: bool = False
    """Recompute proximal logprobs and weight by the capped behaviour ratio (off-policy)."""
    behav_imp_weight_cap: float | None = 5.0
    """Cap of the behaviour importance weight in the decoupled loss."""
    recompute_logprobs: bool = False
    """Recompute old logprobs with the trainer's model instead of using the engine's."""
    temperature: float | None = None
    """Temperature used to recompute logprobs (default: gconfig.temperature)."""
    micro_batch_tokens: int = 4096
    """Tokens per forward/backward micro-batch (gradient accumulation); with tree training, the
    trie nodes per packed sequence."""
    tree_training: Literal["auto", "on", "off"] = "auto"
    """Pack rows sharing token prefixes (GRPO groups, multi-turn) into a token trie, computed once
    with a tree attention mask. auto = when it saves at least a quarter of the tokens. Works with
    strategy fsdp (each rank packs its share of the rows) and LoRA."""
    tree_attention: Literal["auto", "flex", "sdpa"] = "auto"
    """The attention kernel of tree training. flex = PyTorch's FlexAttention with a block mask
    built from the trie (only the blocks holding ancestors are computed; compiled once per
    shape bucket; CUDA only: its backward is not implemented on the CPU); sdpa = the
    trunk/segment sdpa path (any device). auto = flex on CUDA, sdpa elsewhere."""
    logprob_chunk_tokens: int = 1024
    """Token positions per chunk of the LM head + log-softmax: the [tokens, vocab] logits are
    never materialised in full (recomputed chunk by chunk in the backward pass). 0 = one chunk."""
    lossy_low_precision_weights: bool = False
    """Keep the trained weights and AdamW states in ``model.dtype`` (bf16/fp16) instead of fp32:
    8 instead of 16 bytes per parameter, but every update smaller than half a ulp of its weight
    is rounded away (a bf16 ulp is ~0.4-0.8 % of the weight): at RL learning rates (1e-7 to
    1e-5) almost no weight moves (measured: 0.3 % changed by an lr 1e-6 step, 99.8 % in fp32).
    No effect when model.dtype resolves to float32."""

    def validate(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"actor.lr={self.lr!r} must be > 0")
        if self.lr_warmup_steps < 0:
            raise ConfigError(
                f"actor.lr_warmup_steps={self.lr_warmup_steps!r} must be >= 0 (0 = no warmup)"
            )
        if self.eps_clip <= 0:
            raise ConfigError(f"actor.eps_clip={self.eps_clip!r} must be > 0")
        if isinstance(self.frozen_layers, bool) or not (
            isinstance(self.frozen_layers, int) and self.frozen_layers >= 0
        ):
            raise ConfigError(
                f"actor.frozen_layers={self.frozen_layers!r} must be an integer >= 0: how many of "
                "the lowest decoder layers are not trained (0 = train them all)"
            )
        if self.ppo_n_minibatches < 1:
            raise ConfigError(f"actor.ppo_n_minibatches={self.ppo_n_minibatches!r} must be >= 1")
        if self.ppo_epochs < 1:
            raise ConfigError(f"actor.ppo_epochs={self.ppo_epochs!r} must be >= 1")
        if self.kl_coef < 0:
            raise ConfigError(f"actor.kl_coef={self.kl_coef!r} must be >= 0")
        if not (isinstance(self.guided_nll_coef, int | float) and self.guided_nll_coef >= 0):
            raise ConfigError(
                f"actor.guided_nll_coef={self.guided_nll_coef!r} must be a number >= 0 (0 = off; "
                "it needs rollout.guided_samples > 0 to have guided tokens to imitate)"
            )
        if not 0 < self.high_entropy_token_share <= 1:
            raise ConfigError(
                f"actor.high_entropy_token_share={self.high_entropy_token_share!r} must be in "
                "(0, 1]: the share of scored tokens trained (1 = all; 0.2 = the top fifth by "
                "entropy)"
            )
        if self.adam_eps <= 0:
            raise ConfigError(f"actor.adam_eps={self.adam_eps!r} must be > 0 (AdamW's epsilon)")
        if len(self.adam_betas) != 2:
            raise ConfigError(f"actor.adam_betas={self.adam_betas!r} must have two values")
        if self.tree_training not in ("auto", "on", "off"):
            raise ConfigError(
                f"actor.tree_training={self.tree_training!r} must be one of auto, on, off"
            )
        if self.micro_batch_tokens < 1:
            raise ConfigError(f"actor.micro_batch_tokens={self.micro_batch_tokens!r} must be >= 1")
        if self.tree_attention not in ("auto", "flex", "sdpa"):
            raise ConfigError(
                f"actor.tree_attention={self.tree_attention!r} must be one of auto, flex, sdpa"
            )
        if self.logprob_chunk_tokens < 0:
            raise ConfigError(
                f"actor.logprob_chunk_tokens={self.logprob_chunk_tokens!r} must be >= 0 "
                "(0 = the whole micro-batch in one chunk)"
            )


@dataclass
class TrainerConfig:
    """The training loop."""

    total_train_steps: int | None = None
    """Stop after this many steps (default: one pass over the dataset per epoch)."""
    total_train_epochs: int = 1
    """Passes over the dataset when total_train_steps is not set."""
    save_freq_steps: int | None = None
    """Checkpoint every N steps (and always at the end). None = only at the end."""
    keep_checkpoints: int | None = 2
    """Newest checkpoints kept on disk (older ones are deleted); None = keep all."""
    recover: Literal["auto", "off"] = "auto"
    """auto = resume from the trial's last checkpoint if there is one; off = start fresh."""
    redraw_batches_without_signal: int = 0
    """DAPO's dynamic sampling, per batch: over the whole run, up to this many batches whose
    advantages are all 0 (every reward equal, e.g. no episode right: nothing to learn from) are
    replaced by a fresh batch from the data within the same step, instead of the step ending
    without an update. Each redraw costs one more rollout (logged as ``rollout/redrawn``).
    0 = off. Dataset training only (an external source's batches are what its agents sent)."""
    eval_freq_steps: int | None = None
    """Evaluate on valid_dataset every N steps (None = only before the first and after the last
    step). Evaluation is greedy; it needs ``valid_dataset``."""
    eval_before_training: bool = True
    """With a valid_dataset: evaluate the model before the first training step (the baseline)."""
    eval_success_reward: float = 1.0
    """An evaluation episode counts as a success when its reward is at least this."""
    tensorboard: bool = True
    """Also write metrics for TensorBoard (run_dir/tensorboard)."""
    progress: bool = True
    """Show a progress bar."""
    malloc_mmap_threshold_mb: float = 2.0
    """Linux (glibc): memory blocks at least this large are mapped on their own and given back to
    the OS when freed; smaller ones come from the heap, whose freed memory is reused without
    page faults. Larger is faster and holds more memory: the demo actor's update (15 frozen
    layers) took 31.8-32.8 s at 2 MB and 27.7 s at 32 MB, for 0.25 GB more at its peak
    (``bench/train_step.py --case allocator``; docs/training.md, "Memory"). At most 32 (glibc's
    limit); ``MALLOC_MMAP_THRESHOLD_`` in the environment takes precedence."""

    def validate(self) -> None:
        if not 0 < self.malloc_mmap_threshold_mb <= 32:
            raise ConfigError(
                f"trainer.malloc_mmap_threshold_mb={self.malloc_mmap_threshold_mb!r} must be in "
                "(0, 32] (glibc's largest threshold is 32 MB)"
            )
        if self.total_train_steps is not None and self.total_train_steps < 1:
            raise ConfigError(f"trainer.total_train_steps={self.total_train_steps!r} must be >= 1")
        if self.total_train_epochs < 1:
            raise ConfigError(
                f"trainer.total_train_epochs={self.total_train_epochs!r} must be >= 1"
            )
        if self.save_freq_steps is not None and self.save_freq_steps < 1:
            raise ConfigError(f"trainer.save_freq_steps={self.save_freq_steps!r} must be >= 1")
        if self.keep_checkpoints is not None and self.keep_checkpoints < 1:
            raise ConfigError(
                f"trainer.keep_checkpoints={self.keep_checkpoints!r} must be >= 1 "
                "(or null: keep every checkpoint)"
            )
        if self.redraw_batches_without_signal < 0:
            raise ConfigError(
                "trainer.redraw_batches_without_signal="
                f"{self.redraw_batches_without_signal!r} must be >= 0 (0 = off)"
            )
        if self.eval_freq_steps is not None and self.eval_freq_steps < 1:
            raise ConfigError(
                f"trainer.eval_freq_steps={self.eval_freq_steps!r} must be >= 1 (or null: "
                "evaluate only before and after training)"
            )


@dataclass
class ExperimentConfig:
    """The whole configuration of a training run."""

    experiment_name: str = "areal-env"
    """Name of the experiment; outputs go to fileroot/experiment_name/trial_name."""
    trial_name: str = "trial0"
    """Name of this run of the experiment (checkpoints are resumed per trial)."""
    fileroot: str = path_field("dir", default="./outputs")
    """Root folder of all outputs (metrics, plots, dumps, checkpoints). Like every path in a
    config file, relative to the file's folder; the default, to the working directory."""
    seed: int = 1
    """Seed of data shuffling, sampling and initialisation."""
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    gconfig: GenerationConfig = field(
        default_factory=lambda: GenerationConfig(max_new_tokens=128, temperature=1.0)
    )
    actor: ActorConfig = field(default_factory=ActorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    service: ServiceConfig = field(default_factory=ServiceConfig)
    """The any-agent training service (``areal-env serve-training``)."""
    policies: dict[str, PolicyConfig] = field(default_factory=dict)
    """Several trainable policies behind one proxy (multi-agent RL): ``name -> PolicyConfig``.
    A request's ``model`` field names the policy that answers it (an unknown name gets 404
    ``model_not_found``); each policy is trained on its own completions. Empty (the default):
    one policy, the base model, served under any model name."""
    workflow: str | None = path_field("import", default=None)
    """Import string of the agent/workflow (``pkg.mod:Attr`` or ``path.py:Attr``)."""
    workflow_kwargs: dict[str, Any] = path_field(WORKFLOW_KWARGS_PATHS, default_factory=dict)
    """Keyword arguments for the workflow/agent class. Paths in it (``reward_fn``,
    ``mcp_config.command`` and ``cwd``, ``aenv_config.server_python``) are relative to the
    config file like every other path; a stdio MCP server starts in the file's folder."""
    train_dataset: str | None = path_field("file", default=None)
    """JSONL path of the training data (when using the CLI)."""
    valid_dataset: str | None = path_field("file", default=None)
    """JSONL path of evaluation data (optional)."""
    extra_valid_datasets: dict[str, str] = path_field({"*": "file"}, default_factory=dict)
    """More held-out sets, evaluated beside ``valid_dataset`` and reported apart
    (``eval/<name>/...``): a name -> a JSONL path, e.g. ``{new_phrasing: valid_new.jsonl}`` to
    see whether a gain holds on phrasings the training data never uses."""

    @property
    def run_dir(self) -> Path:
        return Path(self.fileroot) / self.experiment_name / self.trial_name

    def validate(self) -> None:
        for name in ("experiment_name", "trial_name"):
            value = getattr(self, name)
            if not value or "/" in value or value in (".", ".."):
                raise ConfigError(f"{name}={value!r} must be a non-empty name without '/'")
        for name in self.extra_valid_datasets:
            if not name or "/" in name:
                raise ConfigError(
                    f"extra_valid_datasets: {name!r} is not a usable set name (a non-empty name "
                    "without '/': it becomes a metric prefix, eval/<name>/success_rate)"
                )
        if self.extra_valid_datasets and not self.valid_dataset:
            raise ConfigError(
                "extra_valid_datasets are evaluated beside valid_dataset: set valid_dataset too"
            )
        for name, policy in self.policies.items():
            self._validate_policy(name, policy)

    def _validate_policy(self, name: str, policy: PolicyConfig) -> None:
        """A policy's name (a request's ``model`` field, a folder name) and its settings."""
        where = f"policies.{name}"
        if not isinstance(name, str) or not _POLICY_NAME.fullmatch(name):
            raise ConfigError(
                f"policy name {name!r} is invalid: use letters, digits, '.', '_' or '-' (at most "
                "64, starting with a letter or digit); it is the `model` agents send and a folder "
                "name in checkpoints"
            )
        taken = {self.model.path, Path(self.model.path).name, self.proxy.model_name}
        if name in taken:
            raise ConfigError(
                f"policy name {name!r} is the base model's name ({self.model.path!r}): a request "
                "naming it would be ambiguous (the base model or the policy?); rename the policy, "
                f"e.g. {name.split('/')[-1]}-policy"
            )
        if not policy.is_adapter and policy.lora is not None:
            raise ConfigError(
                f"{where} sets both model and lora: a policy with a model of its own trains all "
                f"of its weights; remove {where}.lora (or {where}.model for an adapter on the "
                "base model)"
            )
        if policy.is_adapter and policy.addresses:
            raise ConfigError(
                f"{where}.addresses: an adapter policy is served by the base model's engine; "
                f"only a policy with a model of its own ({where}.model) has servers of its own"
            )
        if not policy.is_adapter and self.engine.backend == "remote" and not policy.addresses:
            raise ConfigError(
                f"{where}.model with engine.backend=remote needs {where}.addresses: the "
                "host:port of servers that serve that model"
            )
        try:
            self.policy_actor(name).validate()
            if policy.lora is not None:
                policy.lora.validate()
        except ConfigError as e:
            raise ConfigError(
                str(e).replace("actor.lora.", f"{where}.lora.").replace("actor.", f"{where}.")
            ) from None

    def policy_actor(self, name: str) -> ActorConfig:
        """The ``actor`` settings policy ``name`` trains with: its own optimiser fields over
        the ``actor`` section, and its adapter's shape (``None`` for a full-model policy)."""
        policy = self.policies[name]
        lora = None
        if policy.is_adapter:
            lora = policy.lora or self.actor.lora or LoraConfig()
        return dataclasses.replace(self.actor, lora=lora, **policy.optimiser_overrides())


def load_config(
    cls: type[T] = ExperimentConfig,  # type: ignore[assignment]
    path: str | os.PathLike[str] | None = None,
    overrides: list[str] | None = None,
) -> T:
    """Load ``cls`` from an optional YAML file plus dotted overrides, then validate it. Relative
    paths in the file are relative to its folder; every declared path is checked now (a missing
    dataset, agent file, reward file or MCP server command fails before a model loads)."""
    cfg = config_from_dict(cls, read_config_data(path, overrides, cls))
    check_config_paths(cfg)
    return cfg
