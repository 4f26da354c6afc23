"""Find a model, read its config and fill its weights: HF folders (safetensors) and GGUF files."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvserve.config import ModelConfig, QuantConfig
from kvserve.model import gguf_file, weight_cache
from kvserve.model.default_model import verified_default_model_path
from kvserve.model.quant.plan import assign_quant_methods
from kvserve.model.registry import model_class
from kvserve.model.sharding import TensorShard
from kvserve.model.weight_arena import pack_linear_weights


def resolve_model_path(model: str | Path | None) -> Path:
    """None means the bundled default model; anything else must be a folder or a .gguf file."""
    if model is None:
        return verified_default_model_path()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model={str(model)!r}: folder has no config.json")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise ValueError(f"model={str(model)!r} is not a model folder (with config.json) or a .gguf file")


def auto_dtype(path: Path, device: torch.device) -> str:
    """What dtype="auto" runs a checkpoint in on ``device``, like vLLM's "auto": a float32
    checkpoint stays float32; a 16-bit one, or a GGUF file (its blocks dequantize to any), runs in
    bfloat16 where the device computes it natively (CUDA: float16 for a float16 checkpoint or a GPU
    without bf16; a CPU with AVX512-BF16 or AMX, which the C++ kernels use), else in float32, since
    emulated bf16 is far slower than float32. Native bf16 prefills several times as fast as float32
    at the same perplexity to three digits."""
    stored = _stored_dtype(load_hf_config(path))
    if stored == "float32":
        return "float32"
    if device.type == "cuda":
        return "bfloat16" if stored != "float16" and torch.cuda.is_bf16_supported() else "float16"
    from kvserve.model.cpu_kernels import cpu_has_native_bf16

    return "bfloat16" if cpu_has_native_bf16() else "float32"


def float32_checkpoint(path: Path) -> bool:
    """The checkpoint's weights are float32 (dtype "auto" keeps them so on every device)."""
    return _stored_dtype(load_hf_config(path)) == "float32"


def resolve_auto(dtype: str, quant: QuantConfig, path: Path, device: torch.device) -> tuple[str, QuantConfig]:
    """``dtype`` and ``quant.activation_quantization`` with their "auto"s resolved, together: x stays
    float in a run that is float32 by choice (asked for, or a float32 checkpoint under "auto"), not in
    one that is float32 only because the CPU lacks bf16 (QuantConfig.int8_activations)."""
    by_choice = dtype == "float32" or (dtype == "auto" and float32_checkpoint(path))
    activations = "int8" if quant.int8_activations(by_choice) else "none"
    quant = dataclasses.replace(quant, activation_quantization=activations)
    return (auto_dtype(path, device) if dtype == "auto" else dtype), quant


def _stored_dtype(hf: dict[str, Any]) -> str | None:
    stored = hf.get("torch_dtype") or hf.get("dtype")  # transformers 5 writes "dtype"
    return "float32" if stored == "float" else stored


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def load_hf_config(path: str | Path) -> dict[str, Any]:
    """The HF config.json dict of a model folder, or one built from a GGUF file's metadata."""
    path = Path(path)
    if is_gguf(path):
        return gguf_file.read_config(path)
    with open(path / "config.json") as f:
        return json.load(f)


def load_model_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    cfg = ModelConfig.from_hf(load_hf_config(path))
    if not is_gguf(path):
        cfg = _with_generation_eos(cfg, path)
    return cfg


def _with_generation_eos(cfg: ModelConfig, path: Path) -> ModelConfig:
    """generation_config.json may list extra EOS ids (e.g. Llama 3's <|eot_id|>)."""
    gen = path / "generation_config.json"
    if not gen.is_file():
        return cfg
    eos = json.loads(gen.read_text()).get("eos_token_id")
    extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    merged = tuple(dict.fromkeys([*cfg.eos_token_ids, *extra]))
    return ModelConfig(**{**cfg.__dict__, "eos_token_ids": merged})


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {path} has no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(path: Path, dtype: torch.dtype, device: torch.device, quant: QuantConfig | None = None,
               max_model_len: int | None = None, shard: TensorShard | None = None,
               weight_cache_gb: float = 0.0) -> tuple[torch.nn.Module, ModelConfig]:
    """Build the registered model class for the checkpoint and fill every parameter.

    ``quant``: the weights' quantization and how its linears take x (kvserve.model.quant.plan; the
    default keeps a GGUF file's own block quantization and a float checkpoint dense in ``dtype``).
    ``max_model_len`` caps the config's ``max_position``: the RoPE tables need no more, and LongRoPE
    picks its factors by it. ``shard``: build and fill only this tensor-parallel rank's part
    (model/sharding.py); the model's own config is then that part's, while the config returned is
    the whole model's. ``weight_cache_gb``: keep the converted weights on disk within this budget and
    read them back on a later load (model/weight_cache.py); 0 converts every time.
    """
    quant = quant or QuantConfig()
    hf = load_hf_config(path)
    config = load_model_config(path)
    if max_model_len is not None and max_model_len < config.max_position:
        config = dataclasses.replace(config, max_position=max_model_len)
    cls = model_class(config.architecture)
    local = config if shard is None else shard.local_config(config)
    gguf = is_gguf(path)
    with torch.device(device):
        model = cls(local, dtype)
        assign_quant_methods(model, quant, gguf_file.tensor_types(path) if gguf else None)
    # a load that converts (GGUF blocks, quantization at load) on one CPU process: worth keeping
    converts = gguf or quant.quantization not in (None, "none")
    key = None
    if weight_cache_gb > 0 and converts and device.type == "cpu" and shard is None:
        key = weight_cache.cache_key(path, dtype, quant, max_model_len)
        if weight_cache.restore(model, key):
            return model.eval(), config
    weights = gguf_file.iter_weights(path, hf, keep_blocks=quant.quantization != "none") if gguf else iter_safetensors(path)
    if shard is not None:
        weights = shard.shard_weights(config, weights)
    model.load_weights(weights)
    if device.type == "cpu":
        pack_linear_weights(model)
    if key is not None:
        weight_cache.save(model, key, int(weight_cache_gb * 2**30))
    return model.eval(), config
