"""kvserve's cache folder (``$KVSERVE_CACHE_DIR``, default ``~/.cache/kvserve``): what is costly to
build once and cheap to read back: compiled kernels, GGUF header indexes, converted tokenizers, the
detokenizer's byte tables, the default model's checksum marker."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("KVSERVE_CACHE_DIR", Path.home() / ".cache" / "kvserve"))


def file_version(path: Path) -> str:
    """What names a version of a file in a cache key: its size and modification time, which any
    rewrite (a reinstall, a rebuild, an edit) changes."""
    stat = path.stat()
    return f"{stat.st_size}-{stat.st_mtime_ns}"


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename, so that a concurrent reader
    never sees half a file. Raises OSError (a read-only folder: callers build again next time)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_bytes(data)
    partial.replace(path)
