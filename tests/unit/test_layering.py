"""Imports run one way: no module imports from a package above its own, and no circle between packages.

The layers follow a request's trip downwards (docs/design.md). Every import counts, the lazy ones
inside functions and the type-only ones too. Within a package modules may import each other (the
plug-in registries import the modules that register themselves), but packages never form a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvserve

ROOT = Path(kvserve.__file__).parent

# Highest first; packages on one line are one layer and may import each other (without a circle).
LAYERS = [
    ["cli"],  # the `kvserve` command
    ["bench", "eval", "planner"],  # tools around the engine
    ["__init__"],  # the public facade: `from kvserve import LLM, SamplingParams`
    ["entrypoints"],  # LLM(...) and the OpenAI server
    ["frontend"],  # text: tokenizer, detokenizer, LLMEngine, the engine thread
    ["metrics"],
    ["engine"],  # EngineCore: token ids only
    ["spec_decode"],
    ["worker"],  # the model runner
    ["scheduler"],
    ["kv_cache"],
    ["sample"],
    ["model"],
    ["runtime"],  # process-wide settings: threads, allocator, host memory, the disk cache
    ["config", "request", "types"],
]
RANK = {package: len(LAYERS) - i for i, layer in enumerate(LAYERS) for package in layer}


def _package(module: str) -> str | None:
    """``kvserve.x.y`` -> ``x``; ``kvserve`` -> ``__init__``; None outside kvserve."""
    parts = module.split(".")
    if parts[0] != "kvserve":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _is_module(name: str) -> bool:
    path = ROOT.parent / name.replace(".", "/")
    return path.is_dir() or path.with_suffix(".py").exists()


def _imports(path: Path) -> set[str]:
    module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: len(module.split(".")) - node.level + (path.name == "__init__.py")]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            # `from kvserve import x` imports the submodule x when there is one
            out |= {f"{name}.{a.name}" if _is_module(f"{name}.{a.name}") else name for a in node.names}
    return out


def _edges() -> dict[tuple[str, str], list[str]]:
    """(from package, to package) -> the modules whose imports make that edge."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        src = rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.name != "__init__.py" else "__init__"
        for name in _imports(path):
            dst = _package(name)
            if dst is not None and dst != src:
                edges.setdefault((src, dst), []).append(str(rel))
    return edges


def test_every_package_has_a_layer():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    packages |= {p.stem for p in ROOT.glob("*.py")}
    assert packages - set(RANK) == set(), "add new packages to LAYERS"


def test_no_import_runs_up_the_layers():
    upward = [f"{src} -> {dst} ({', '.join(where)})" for (src, dst), where in _edges().items()
              if RANK[dst] > RANK[src]]
    assert upward == []


def test_no_circle_between_packages():
    graph: dict[str, set[str]] = {}
    for src, dst in _edges():
        graph.setdefault(src, set()).add(dst)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt):] + [node, nxt]) if nxt in path else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert circles == []


def test_the_walker_sees_imports():
    """The checks above must be able to fail: known edges are found."""
    edges = _edges()
    assert ("engine", "scheduler") in edges and ("frontend", "engine") in edges
    assert ("entrypoints", "frontend") in edges
