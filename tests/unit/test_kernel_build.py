"""The C++ kernels build from copies in the build directory, so the paths torch keys its build on do
not change with where kvserve is checked out or installed."""

from __future__ import annotations

from pathlib import Path

from kvserve.model import cpu_kernels


def test_sources_are_staged_in_the_build_directory_and_rewritten_only_when_changed(tmp_path):
    sources, include = cpu_kernels._staged_sources(tmp_path)
    staged = tmp_path / "src"
    assert include == str(staged)
    assert sorted(Path(p).name for p in sources) == sorted(p.name for p in cpu_kernels._SOURCES)
    for original in [*cpu_kernels._SOURCES, *cpu_kernels._HEADERS[0].glob("*.h")]:
        assert (staged / original.name).read_bytes() == original.read_bytes()
    first = {p: p.stat().st_mtime_ns for p in staged.iterdir()}
    (staged / "simd.h").write_text("stale")
    again, _ = cpu_kernels._staged_sources(tmp_path)
    assert again == sources
    assert (staged / "simd.h").read_bytes() == (cpu_kernels._HEADERS[0] / "simd.h").read_bytes()
    assert all(p.stat().st_mtime_ns == t for p, t in first.items() if p.name != "simd.h")
