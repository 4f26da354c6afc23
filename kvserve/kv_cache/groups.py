"""KV groups: which layers share a block table. Pure Python, no torch.

A model whose layers all attend alike (all fully, or all over one sliding window) has one group:
every block holds the KV of every layer. A hybrid model (Gemma 2: local and global layers
alternate; Gemma 3: five local per global) has several: the layers of one kind are split into
groups of ``layers_per_block`` layers each, and every group keeps its own block table per request.
A block of the one shared pool holds ``layers_per_block`` layers' KV for ``block_size`` tokens, so
blocks are interchangeable between groups and the pool serves whichever kind needs them; a window
group releases the blocks behind its window as a sequence grows, a full group keeps them all.
``layers_per_block`` is the gcd of the kinds' layer counts: no block holds a padding layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.kv_cache.sizing import kv_layers_per_block


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table per request; ``window`` None: they attend fully."""

    window: int | None
    layers: tuple[int, ...]

    @property
    def kind(self) -> str:
        return "full" if self.window is None else "window"


@dataclass(frozen=True)
class KVLayout:
    """The model's KV groups; layer ``groups[g].layers[s]`` stores its KV in slot ``s`` of group ``g``'s blocks."""

    groups: tuple[KVGroup, ...]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def layers_per_block(self) -> int:
        return len(self.groups[0].layers)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    def group_of_layer(self) -> list[int]:
        """Each layer's group index, by layer."""
        owner = {layer: g for g, group in enumerate(self.groups) for layer in group.layers}
        return [owner[i] for i in range(len(owner))]

    def slot_of_layer(self) -> list[int]:
        """Each layer's slot within its group's blocks, by layer."""
        slot = {layer: s for group in self.groups for s, layer in enumerate(group.layers)}
        return [slot[i] for i in range(len(slot))]


def single_layout(num_layers: int, window: int | None = None) -> KVLayout:
    """One group of every layer: a block holds all layers' KV (``window`` when every layer slides)."""
    return KVLayout((KVGroup(window, tuple(range(num_layers))),))


def kv_layout(layer_windows: tuple[int | None, ...], num_layers: int, hybrid: bool = True) -> KVLayout:
    """The groups of a model with these per-layer windows. ``hybrid`` False (a runner that cannot
    read per-group tables) keeps one group, windowed only if every layer slides over one window."""
    windows = layer_windows or (None,) * num_layers
    kinds = sorted(set(windows), key=lambda w: -1 if w is None else w)  # full first: group 0 is full
    if len(kinds) == 1 or not hybrid:
        return single_layout(num_layers, kinds[0] if len(kinds) == 1 else None)
    per_block = kv_layers_per_block([windows.count(w) for w in kinds])
    groups = []
    for w in kinds:
        layers = [i for i, lw in enumerate(windows) if lw == w]
        groups += [KVGroup(w, tuple(layers[j:j + per_block])) for j in range(0, len(layers), per_block)]
    return KVLayout(tuple(groups))
