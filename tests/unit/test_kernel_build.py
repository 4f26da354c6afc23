"""The C++ kernels build from copies in the build directory, so the paths torch keys its build on do
not change with where kvserve is checked out or installed."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.model import cpu_kernels
from kvserve.runtime import threads


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


def test_a_build_stopped_midway_does_not_block_the_next(tmp_path):
    """torch's lock file, left by a build that was killed, is removed once we hold our own flock; a
    second holder waits for the first (the flock serialises builds of one directory)."""
    import fcntl
    import threading

    (tmp_path / "lock").touch()  # what a killed build leaves behind
    with cpu_kernels._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        got_in = threading.Event()

        def second():
            with cpu_kernels._build_lock(tmp_path):
                got_in.set()

        waiter = threading.Thread(target=second)
        waiter.start()
        assert not got_in.wait(0.3)  # blocked while we hold it
    waiter.join(5)
    assert got_in.is_set()
    with open(tmp_path / "kvserve.lock") as handle:  # released: free to take
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)


@pytest.mark.parametrize("vendor, family, flags", [
    ("GenuineIntel", 6, []),
    ("AuthenticAMD", 25, ["-DKVSERVE_AMD"]),                        # Zen 3 / Zen 4
    ("AuthenticAMD", 26, ["-DKVSERVE_AMD", "-DKVSERVE_AMD_ZEN5"]),  # Zen 5
    ("AuthenticAMD", None, ["-DKVSERVE_AMD"]),
    ("", None, []),
])
def test_kernel_tuning_flags_follow_the_cpu(vendor, family, flags):
    assert cpu_kernels.vendor_flags(vendor, family) == flags


def test_cpuinfo_fields_are_read_by_name(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
                       "processor\t: 1\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo" else path,
                                                                         *a, **k))
    assert threads.cpu_vendor() == "AuthenticAMD"
    assert threads.cpu_family() == 26
    cpuinfo.write_text("processor\t: 0\n")  # no such fields (some ARM kernels)
    assert threads.cpu_vendor() == "" and threads.cpu_family() is None


def test_the_build_key_includes_the_torch_installation(monkeypatch):
    """Two environments (a test venv, a serving venv) build apart instead of rebuilding each other's."""
    flags = ["-O3"]
    here = cpu_kernels.build_key(flags)
    assert cpu_kernels.build_key(flags) == here
    monkeypatch.setattr(cpu_kernels, "torch_signature", lambda: "2.13.0:/elsewhere/site-packages/torch")
    assert cpu_kernels.build_key(flags) != here


def test_a_first_build_says_so(capsys, monkeypatch):
    monkeypatch.setattr(cpu_kernels.logging.getLogger(), "handlers", [])
    cpu_kernels._say("kvserve: compiling")
    assert "kvserve: compiling" in capsys.readouterr().err


def test_kernel_targets():
    """KVSERVE_CPU_TARGET picks -march (avx2: x86-64-v3, an AVX2-only CPU); a build per target, since
    the flags are part of the build key; a misspelt target is an error, not a silent native build."""
    assert cpu_kernels.target_flags("native") == ["-march=native"]
    assert cpu_kernels.target_flags("avx2") == ["-march=x86-64-v3"]
    assert cpu_kernels.build_key(cpu_kernels.target_flags("avx2")) != cpu_kernels.build_key(["-march=native"])
    with pytest.raises(ValueError, match="KVSERVE_CPU_TARGET"):
        cpu_kernels.target_flags("avx3")


def test_a_finished_build_is_imported_without_the_build_tool():
    """Once a build has loaded, later processes import its library directly: the build tool's imports
    (torch.utils.cpp_extension, setuptools) cost a server's start ~0.2 s."""
    import subprocess
    import sys

    if cpu_kernels.load_kernels() is None:
        pytest.skip("the C++ kernels cannot be built here")
    code = ("import sys; from kvserve.model.cpu_kernels import load_kernels; m = load_kernels(); "
            "print(m is not None and m.vector_bits() > 0, 'torch.utils.cpp_extension' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False"]


def test_a_library_that_changed_since_it_loaded_goes_through_the_build_tool(monkeypatch):
    """A library whose size or time is not the stamp's (a build stopped midway, a file replaced) is
    never imported directly."""
    if cpu_kernels.load_kernels() is None:
        pytest.skip("the C++ kernels cannot be built here")
    imported = []
    real = cpu_kernels._import_library
    monkeypatch.setattr(cpu_kernels, "_import_library", lambda *a: imported.append(a) or real(*a))
    assert cpu_kernels.load_kernels.__wrapped__() is not None
    assert len(imported) == 1  # the stamp matches: imported directly
    library = Path(imported[0][1])
    monkeypatch.setattr(cpu_kernels, "file_version", lambda path: "another size and time")
    try:
        assert cpu_kernels.load_kernels.__wrapped__() is not None
        assert len(imported) == 1  # loaded by the build tool, which checked the library first
    finally:
        monkeypatch.undo()
        (library.parent / "built").write_text(cpu_kernels.file_version(library))
    # The build tool's pass left the build's key as it was (torch's loader appends its own flags to
    # the list of link flags it is given): the next load imports the same library directly.
    monkeypatch.setattr(cpu_kernels, "_import_library", lambda *a: imported.append(a) or real(*a))
    assert cpu_kernels.load_kernels.__wrapped__() is not None
    assert [Path(a[1]) for a in imported] == [library, library]
