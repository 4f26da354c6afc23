"""The glibc thresholds are applied once on Linux/glibc, and skipped cleanly anywhere else."""

from __future__ import annotations

import ctypes

from kvserve.runtime import allocator


def test_thresholds_apply_on_glibc(monkeypatch):
    calls = []

    class FakeLibc:
        gnu_get_libc_version = object()

        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    monkeypatch.setattr(ctypes, "CDLL", lambda name: FakeLibc())
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    allocator.keep_freed_memory.cache_clear()
    try:
        assert allocator.keep_freed_memory() and allocator.keep_freed_memory()
        assert calls == [(allocator.M_MMAP_THRESHOLD, allocator.MMAP_THRESHOLD),
                         (allocator.M_TRIM_THRESHOLD, allocator.TRIM_THRESHOLD)]  # once per process
    finally:
        allocator.keep_freed_memory.cache_clear()


def test_other_c_libraries_are_left_alone(monkeypatch):
    class Musl:
        def mallopt(self, param, value):  # pragma: no cover - must not be reached
            raise AssertionError("mallopt called on a non-glibc libc")

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Musl())
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    allocator.keep_freed_memory.cache_clear()
    try:
        assert not allocator.keep_freed_memory()
    finally:
        allocator.keep_freed_memory.cache_clear()


def test_the_real_libc_accepts_them():
    allocator.keep_freed_memory.cache_clear()
    assert allocator.keep_freed_memory() == allocator.sys.platform.startswith("linux")
