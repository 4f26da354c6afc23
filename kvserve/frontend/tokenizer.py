"""Loading the Hugging Face tokenizer of a model folder or a GGUF file.

Building a fast tokenizer from GGUF metadata takes seconds, so the converted tokenizer is saved
once under the cache folder (``$KVSERVE_CACHE_DIR``, default ``~/.cache/kvserve``) and reloaded
from there, keyed by the file's name, size and modification time.
"""

from __future__ import annotations

import os
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def cache_dir() -> Path:
    return Path(os.environ.get("KVSERVE_CACHE_DIR", Path.home() / ".cache" / "kvserve"))


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path))
    stat = path.stat()
    cached = cache_dir() / "tokenizers" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if (cached / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except (OSError, ValueError):
            pass  # a damaged cache entry: rebuild it below
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        tokenizer.save_pretrained(str(cached))
    except OSError:
        pass  # read-only home: still works, just slower next time
    return tokenizer
