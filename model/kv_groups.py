"""Which KV cache and page table each layer uses on a hybrid model (some layers attend
over a sliding window, the others over everything: Gemma 2, Gemma 3, gpt-oss).

On such a model the window layers keep their K/V in a cache of their own, with a page table
of their own (`Batch.window_page_table`), so the pages that fall behind the window go back
to a small pool while the full-attention layers keep every page of theirs
(docs/architecture.md, "Sliding windows and hybrid KV"). A model with one kind of layer, or
a cache built without a window part, keeps one cache and one table for every layer.
"""
from __future__ import annotations

from model.config import LINEAR_MIXERS, STATEFUL, ModelConfig


def layer_windows(cfg: ModelConfig) -> tuple[int, ...]:
    return cfg.sliding_windows or (0,) * cfg.num_layers


def is_hybrid(cfg: ModelConfig) -> bool:
    """Some layers attend over a window and some over every key."""
    windows = layer_windows(cfg)
    return any(w > 0 for w in windows) and any(w <= 0 for w in windows)


def group_window(cfg: ModelConfig) -> int:
    """The widest window of the window layers: what their own pages must keep (0: none)."""
    return max(layer_windows(cfg), default=0)


def num_group_layers(cfg: ModelConfig) -> tuple[int, int]:
    """(full-attention layers, window layers) of a hybrid model."""
    window = sum(1 for w in layer_windows(cfg) if w > 0)
    return cfg.num_kv_layers - window, window


def kv_layers(cfg: ModelConfig, split: bool) -> list[tuple[bool, int]]:
    """For each layer, (in the window cache?, its index in that cache). split: the cache
    has a window part; else every attention layer is in the one cache. A linear layer's
    index is among the linear layers (its slot of the RecurrentState); a layer with no
    mixer (an MLP block) keeps nothing, and its index means nothing. A "hybrid" layer's is
    its K/V index; `state_layers` gives its state's."""
    out, count = [], {}
    for i, w in enumerate(layer_windows(cfg)):
        mixer = cfg.mixer(i)
        group = ("none" if mixer == "none" else "linear" if mixer in LINEAR_MIXERS else
                 "window" if split and w > 0 else "full")
        out.append((group == "window", count.get(group, 0)))
        count[group] = count.get(group, 0) + 1
    return out


def state_layers(cfg: ModelConfig) -> list[int]:
    """Each layer's index in the RecurrentState (its place among the layers that keep one;
    0 for the others, where it means nothing)."""
    out, count = [], 0
    for i in range(cfg.num_layers):
        out.append(count if cfg.mixer(i) in STATEFUL else 0)
        count += cfg.mixer(i) in STATEFUL
    return out
