"""What the A/B scripts (ab_revisions.py, ab_cpu_target.py) share: an older revision unpacked beside
this tree, and rounds that alternate the two trees with the order flipping every round, so that
both see the same machine."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@contextmanager
def old_revision(rev: str) -> Iterator[Path]:
    """The tree of git revision ``rev`` (``git archive``) in a temporary folder, removed after. Its C++
    kernels compile on first use (a few minutes, cached per source)."""
    with tempfile.TemporaryDirectory(prefix="kvserve-ab-") as tmp:
        tree = Path(tmp) / "old"
        tree.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
        yield tree


def alternate(old: Path, rounds: int, measure: Callable[[Path, int], dict],
              describe: Callable[[dict], str]) -> dict[str, list[dict]]:
    """``measure(tree, round)`` for the old tree and this one in each of ``rounds`` rounds, old first
    in even rounds and new first in odd ones; each result is printed (``describe``) to stderr."""
    trees = {"old": old, "new": REPO}
    results: dict[str, list[dict]] = {"old": [], "new": []}
    for r in range(rounds):
        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
            results[name].append(measure(trees[name], r))
            print(f"round {r + 1} {name}: {describe(results[name][-1])}", file=sys.stderr)
    return results
