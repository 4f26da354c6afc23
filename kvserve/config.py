"""Configuration dataclasses, one per concern.

Every user-facing value is checked here, once, and a bad one raises ``ValueError`` naming the
field, the value and the allowed range, so the rest of the engine can trust its config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
QUANTIZATIONS = ("none", "int8", "int4")
QUANT_GROUP_SIZES = (-1, 32, 64, 128)  # -1: one scale per output channel (int8 only)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map a dtype name ("float32", "bfloat16", "float16") to a torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"dtype={name!r} is not supported; choose one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[name]


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, normalised from `rope_theta` or transformers-5 `rope_parameters`."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> RopeConfig:
        params = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or {}
        params = {**scaling, **params}
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        return RopeConfig(
            theta=float(theta),
            rope_type=str(rope_type),
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=int(params.get("original_max_position_embeddings", 8192)),
        )


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer, read from an HF `config.json` (or GGUF metadata)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
        arch = archs[0]
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        use_sw = cfg.get("use_sliding_window", cfg.get("sliding_window") is not None)
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            max_position=int(cfg.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch.startswith("Qwen2"))),
            qk_norm=arch.startswith("Qwen3"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=cfg.get("sliding_window") if use_sw else None,
        )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size and how many blocks (or how many bytes) to preallocate."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 1024**3
    enable_prefix_caching: bool = True  # reuse the KV of full blocks shared with earlier requests
    # "auto": the model dtype; "int8" / "fp8" (float8_e4m3): one byte per value plus a float16 scale
    # per token and head, about half the bytes per token of a bf16 cache (model/attention/kv_quant.py)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} must be one of {list(KV_CACHE_DTYPES)}")
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size={self.block_size} must be in [1, 1024]")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} must be >= 1 (or None to size from memory)")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} must be > 0")


@dataclass(frozen=True)
class QuantConfig:
    """Weight quantization (kvserve/model/quant/). ``quantization``:

    None (unset): keep a GGUF file's own block quantization (Q4_0/Q4_1/Q4_K as int4, Q8_0/Q5/Q6_K as
    int8 kernels); float checkpoints stay in the engine dtype.
    "none": everything dense in the engine dtype (GGUF blocks dequantized at load).
    "int8": weight-only int8, a scale per ``group_size`` inputs (default 32; -1 = per output channel).
    "int4": weight-only int4 with zero points per ``group_size`` inputs (default 32; see quant/plan.py).
    Both round to nearest at load.
    """

    quantization: str | None = None
    group_size: int | None = None  # -1 (per channel, int8), 32, 64 or 128; None = 32

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r} is not supported; choose one of "
                             f"{list(QUANTIZATIONS)} or leave it unset to keep the checkpoint's own format")
        if self.group_size is not None and self.group_size not in QUANT_GROUP_SIZES:
            raise ValueError(f"quantization_group_size={self.group_size} must be one of {list(QUANT_GROUP_SIZES)}")
        if self.group_size is not None and self.quantization not in ("int8", "int4"):
            raise ValueError(f"quantization_group_size={self.group_size} needs quantization='int8' or 'int4'")
        if self.group_size == -1 and self.quantization != "int8":
            raise ValueError("quantization_group_size=-1 (one scale per output channel) is for quantization='int8'")


SCHEDULING_POLICIES = ("fcfs", "shortest-first")
CUDA_TOKEN_BUDGET = 8192  # max_num_batched_tokens on CUDA unless given (SchedulerConfig's docstring)


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: requests per step and tokens per step (the token budget).

    ``policy``: which waiting request is admitted next, within a priority. "shortest-first" (the
    default): the one with the fewest tokens left to compute (prompt minus cached prefix), so a
    burst's short prompts get their first token without queueing behind long ones; a request passed
    over by four steps' token budget of later arrivals goes next, so long prompts wait a bounded time
    (scheduler/policies.py). "fcfs": arrival order (preferring a cached prefix among the next few).

    ``max_num_batched_tokens``: 1024 by default. A burst's prompts then come out in steps of ~0.25 s
    on two CPU cores instead of ~0.5 s: W2's median first token came 10% sooner than at 2048 for the
    same throughput (benchmarks/RESULTS.md, session 11), and running requests stall half as long.
    On CUDA ``engine_config`` makes it ``CUDA_TOKEN_BUDGET`` unless given: an eager GPU step is mostly
    kernel launches, 10-15 ms for a 128-token prompt and ~26 ms for 8,192 tokens (an H200, session 13).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    policy: str = "shortest-first"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={self.policy!r} must be one of {list(SCHEDULING_POLICIES)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 1")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses up to ``num_speculative_tokens`` tokens per request and
    one target forward pass verifies them all. ``max_batch_size``: speculate only while at most this
    many requests are decoding, since at large batches decode is no longer memory-bound."""

    method: str | None = None  # None (off), "ngram" or "draft"
    num_speculative_tokens: int = 4
    model: str | None = None  # the draft model (same tokenizer), for method "draft"
    ngram_min: int = 1
    ngram_max: int = 4
    max_batch_size: int = 8

    def __post_init__(self) -> None:
        if self.method not in (None, "ngram", "draft"):
            raise ValueError(f"speculative_method={self.method!r} must be None, 'ngram' or 'draft'")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must be in [1, 16]")
        if self.method == "draft" and not self.model:
            raise ValueError("speculative_method='draft' needs speculative_model (a smaller model, same tokenizer)")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram window [{self.ngram_min}, {self.ngram_max}] must satisfy 1 <= min <= max")
        if self.max_batch_size < 1:
            raise ValueError(f"speculative max_batch_size={self.max_batch_size} must be >= 1")


ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs; built by `LLM` or the server from user options."""

    model: str | None = None
    # "auto": what the checkpoint and the device suit (model/loader.py auto_dtype); EngineCore
    # replaces it with the name it resolves to before anything reads torch_dtype.
    dtype: str = "auto"
    seed: int = 0
    device: str = "cpu"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    # "auto": the device's best backend (C++ kernels on the CPU, Triton on CUDA); "torch": the PyTorch
    # reference path; "triton": the Triton kernels (CUDA, or the CPU under TRITON_INTERPRET=1 for tests).
    attention_backend: str = "auto"
    # CUDA only: run decode steps eagerly instead of replaying captured CUDA graphs.
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device={self.device!r} must be 'cpu' or 'cuda[:N]'")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} must be one of {ATTENTION_BACKENDS}")

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            raise RuntimeError("dtype='auto' is resolved when the engine loads the model (EngineCore)")
        return parse_dtype(self.dtype)
