"""Loading the Hugging Face tokenizer of a model folder or a GGUF file.

Building a fast tokenizer from GGUF metadata takes seconds, so the converted tokenizer is saved
once under the cache folder (``$KVSERVE_CACHE_DIR``, default ``~/.cache/kvserve``) and reloaded
from there, keyed by the file's name, size and modification time.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from kvserve.runtime.disk_cache import cache_dir, file_version

# What transformers writes as the class of a plain fast tokenizer (v5 calls it TokenizersBackend).
_PLAIN_FAST = {"TokenizersBackend", "PreTrainedTokenizerFast", PreTrainedTokenizerFast.__name__}


def load_tokenizer(path: Path, chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """The model's tokenizer; ``chat_template`` (a file or the template text) replaces its own."""
    tokenizer = _load(path)
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def read_chat_template(value: str) -> str:
    """The template text of ``--chat-template``: a file's contents, or the value itself; its Jinja
    syntax is checked here, at start-up, not in the first chat request."""
    import jinja2

    if "{" not in value:
        try:
            value = Path(value).expanduser().read_text()
        except OSError as e:
            raise ValueError(f"chat_template {value!r} is neither a readable file nor a template: {e}") from None
    try:
        jinja2.Environment().parse(value)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template is not a valid Jinja template: {e} (line {e.lineno})") from None
    return value


def _load(path: Path) -> PreTrainedTokenizerBase:
    if path.is_dir():
        return _auto_tokenizer(path)
    cached = cache_dir() / "tokenizers" / f"{path.stem}-{file_version(path)}"
    if (cached / "tokenizer.json").is_file():
        try:
            return _load_cached(cached)
        except (OSError, ValueError):
            pass  # a damaged cache entry: rebuild it below
    tokenizer = _auto_tokenizer(path.parent, gguf_file=path.name)
    try:
        tokenizer.save_pretrained(str(cached))
    except OSError:
        pass  # read-only home: still works, just slower next time
    return tokenizer


def _load_cached(folder: Path) -> PreTrainedTokenizerBase:
    """A saved conversion: the plain fast tokenizer class directly when that is what was saved,
    which AutoTokenizer would pick too, without importing AutoTokenizer's registry of every model."""
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if config.get("tokenizer_class") in _PLAIN_FAST:
        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    return _auto_tokenizer(folder)


def _auto_tokenizer(folder: Path, **kwargs) -> PreTrainedTokenizerBase:
    # Imported here, not at the top: the import alone takes 0.5-0.8 s of a server's start, and a
    # cached GGUF conversion (the default model) does without it.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), **kwargs)


def bad_words_token_ids(tokenizer: PreTrainedTokenizerBase, words: list[str]) -> list[list[int]]:
    """Each bad word as the token ids it is generated as: on its own (at the start of the output),
    and after a space (mid-text) where that spelling starts with another token but has as many, as
    vLLM does (a tokenizer that marks the space inside the word's first token)."""
    out: list[list[int]] = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if alone:
            out.append(alone)
        if alone and len(spaced) == len(alone) and spaced[0] != alone[0]:
            out.append(spaced)
    return out
