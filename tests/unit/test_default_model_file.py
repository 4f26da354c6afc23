"""The default model's sha256 check: a wrong file is refused, and a checked file is not hashed again
until it changes."""

from __future__ import annotations

import hashlib
import os

import pytest

from kvserve.model import default_model


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"weights" * 1000)
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "default_model_path", lambda: path)
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_SHA256", hashlib.sha256(path.read_bytes()).hexdigest())
    default_model.verified_default_model_path.cache_clear()
    yield path
    default_model.verified_default_model_path.cache_clear()


def _hashes(monkeypatch) -> list[int]:
    calls = []
    real = hashlib.sha256
    monkeypatch.setattr(default_model.hashlib, "sha256", lambda *a: calls.append(1) or real(*a))
    return calls


def test_checked_once_per_file_version(fake_model, monkeypatch):
    calls = _hashes(monkeypatch)
    assert default_model.verified_default_model_path() == fake_model and len(calls) == 1
    default_model.verified_default_model_path.cache_clear()  # a new process
    assert default_model.verified_default_model_path() == fake_model and len(calls) == 1  # the marker
    fake_model.write_bytes(b"Weights" * 1000)  # same size, new contents and mtime
    os.utime(fake_model, ns=(1, 1))
    default_model.verified_default_model_path.cache_clear()
    with pytest.raises(ValueError, match="expected"):
        default_model.verified_default_model_path()
    assert len(calls) == 2


def test_a_wrong_file_is_never_marked(fake_model, monkeypatch):
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_SHA256", "0" * 64)
    for _ in range(2):
        with pytest.raises(ValueError, match="reinstall"):
            default_model.verified_default_model_path()
        default_model.verified_default_model_path.cache_clear()
    assert not (fake_model.parent / "cache" / "verified").exists()
