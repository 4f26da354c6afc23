"""The weights as loaded, kept under the cache folder so that a later start reads them back instead
of converting the checkpoint again.

Loading a GGUF file repacks its blocks (quant/gguf_blocks.py, then strips for the integer kernels,
quant/packing.py), and a float checkpoint with ``quantization`` is quantized at load: for the
bundled model that is 0.7-0.9 s of a start on a 2-core Zen 3, against 0.13-0.3 s to build the empty
model and read the result back, and the conversion grows with the model. After such a load every
parameter and buffer of the model is written to ``weights/<key>/`` (an index and one blob), keyed
by everything the result depends on: the checkpoint's files and their versions, the dtype, the
quantization options, ``max_model_len`` (the RoPE tables), kvserve's model code and the compiled
kernels (whose build key names the CPU and the instruction set). A later load with the same key
builds the empty model, checks that its parameters and buffers are the ones the index lists, and
reads the blob into them; a storage that several tensors share (the weight arena, tied weights) is
read once into a huge-page-advised buffer again (weight_arena.py). Entries past the
``weight_cache_gb`` budget go, least recently used first. Models under MIN_BYTES are not kept: they
convert in tens of milliseconds anyway.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from kvserve.config import QuantConfig
from kvserve.model.weight_arena import huge_page_buffer
from kvserve.runtime.disk_cache import cache_dir, file_version

log = logging.getLogger(__name__)

MIN_BYTES = 32 << 20
_INDEX, _BLOB = "index.json", "weights.bin"
_FORMAT = 1
_STALE_S = 24 * 3600  # a folder still being written after this was left by a killed process


def cache_key(path: Path, dtype: torch.dtype, quant: QuantConfig, max_model_len: int | None) -> str:
    """The entry's name: a digest of everything the loaded tensors depend on."""
    from kvserve.model.cpu_kernels import load_kernels

    files = [path] if path.is_file() else sorted([path / "config.json", *path.glob("*.safetensors")])
    kernels = load_kernels()
    parts = [str(_FORMAT), str(path.resolve()), *(f"{f.name}:{file_version(f)}" for f in files), str(dtype),
             repr(quant), str(max_model_len), _code_version(), kernels.__name__ if kernels is not None else "no kernels"]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


@functools.cache
def _code_version() -> str:
    """kvserve's model code and config parsing: any edit may change what a load produces."""
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for source in [package / "config.py", *sorted((package / "model").rglob("*.py"))]:
        digest.update(source.read_bytes())
    return digest.hexdigest()


def _slots(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, str, torch.Tensor | None]]:
    """(module, qualified name, kind, tensor) for every parameter and buffer, shared ones under every name."""
    out = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
            for attr, tensor in table.items():
                out.append((module, f"{prefix}.{attr}" if prefix else attr, kind, tensor))
    return out


def restore(model: torch.nn.Module, key: str) -> bool:
    """Fill ``model`` (built, not loaded) from the entry ``key``; False, with ``model`` untouched, where
    there is no such entry or it does not match the model or cannot be read whole."""
    entry = cache_dir() / "weights" / key
    if not (entry / _INDEX).is_file():
        return False
    slots = _slots(model)
    try:
        index = json.loads((entry / _INDEX).read_text())
        if [(name, kind) for _, name, kind, _ in slots] != [(t["name"], t["kind"]) for t in index["tensors"]]:
            raise ValueError("its tensors are not this model's")
        storages = _read_storages(entry, index["storages"])
        tensors = [None if saved["storage"] is None else _view(storages, saved) for saved in index["tensors"]]
    except (OSError, ValueError, KeyError, TypeError, IndexError, RuntimeError) as e:
        # removed, so that this load's save puts a whole entry in its place rather than failing to
        log.warning("weight cache entry %s removed (%s); converting the checkpoint", entry, e)
        shutil.rmtree(entry, ignore_errors=True)
        return False
    for (module, name, kind, _), tensor in zip(slots, tensors):
        attr = name.rpartition(".")[2]
        if kind == "param" and tensor is not None:
            module._parameters[attr].data = tensor
        elif kind == "buffer":
            module._buffers[attr] = tensor
    os.utime(entry)  # most recently used: evicted last
    return True


def _read_storages(entry: Path, sizes: list[int]) -> list[torch.Tensor]:
    storages = []
    with open(entry / _BLOB, "rb") as blob:
        for nbytes in sizes:
            buffer, _ = huge_page_buffer(nbytes)  # the weight arena's pages, as pack_linear_weights has them
            if nbytes and blob.readinto(memoryview(buffer.numpy())) != nbytes:
                raise OSError("the blob is shorter than its index says")
            storages.append(buffer)
    return storages


def _view(storages: list[torch.Tensor], saved: dict) -> torch.Tensor:
    dtype = getattr(torch, saved["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {saved['dtype']!r}")
    return torch.empty(0, dtype=dtype).set_(storages[saved["storage"]].untyped_storage(),
                                            saved["offset"] // dtype.itemsize, saved["shape"], saved["stride"])


def save(model: torch.nn.Module, key: str, budget_bytes: int) -> None:
    """Write ``model``'s parameters and buffers as the entry ``key``, then evict the least recently
    used entries past ``budget_bytes``. Quietly does nothing where the folder cannot be written."""
    tensors, storages, where = [], [], {}
    for _, name, kind, tensor in _slots(model):
        if tensor is None:
            tensors.append({"name": name, "kind": kind, "storage": None})
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in where:
            where[storage.data_ptr()] = len(storages)
            storages.append(storage)
        tensors.append({"name": name, "kind": kind, "storage": where[storage.data_ptr()],
                        "offset": tensor.storage_offset() * tensor.element_size(),
                        "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
                        "stride": list(tensor.stride())})
    total = sum(s.nbytes() for s in storages)
    if total < MIN_BYTES or total > budget_bytes or any(s.device.type != "cpu" for s in storages):
        return
    folder = cache_dir() / "weights"
    partial = folder / f"{key}.{os.getpid()}.tmp"
    try:
        partial.mkdir(parents=True, exist_ok=True)
        with open(partial / _BLOB, "wb") as blob:
            for storage in storages:
                blob.write(memoryview(torch.empty(0, dtype=torch.uint8).set_(storage).numpy()))
        (partial / _INDEX).write_text(json.dumps({"storages": [s.nbytes() for s in storages], "tensors": tensors}))
        partial.rename(folder / key)
    except OSError as e:  # a read-only or full disk, or another process saved it first
        log.debug("weight cache: not saved (%s)", e)
        shutil.rmtree(partial, ignore_errors=True)
        return
    _evict(folder, budget_bytes)


def _evict(folder: Path, budget_bytes: int) -> None:
    entries = []
    for entry in folder.iterdir():
        if entry.suffix == ".tmp":  # being written by another process, or left by a killed one
            with contextlib.suppress(OSError):
                if time.time() - entry.stat().st_mtime > _STALE_S:
                    shutil.rmtree(entry, ignore_errors=True)
            continue
        try:
            entries.append((entry.stat().st_mtime, entry, sum(f.stat().st_size for f in entry.iterdir())))
        except OSError:  # an entry another process is writing or removing
            continue
    total = sum(size for _, _, size in entries)
    for _, entry, size in sorted(entries, key=lambda e: e[0]):
        if total <= budget_bytes:
            break
        shutil.rmtree(entry, ignore_errors=True)
        total -= size
