"""How a hybrid model's KV memory splits between its two page pools (model/kv_groups.py):
the full-attention layers' pages, which hold whole contexts, and the window layers' pages,
of which a request holds only its window's worth (core/kv_hybrid.py).

The window pool is sized for every running request's window: `max_num_seqs` windows and a
step's new tokens, so it is not what limits how many requests run. Where that would take
more than half the KV memory (a long window, many sequences, a small GPU), it gets half,
never less than one request's worth; the scheduler preempts if it runs short.
"""
from __future__ import annotations

from dataclasses import dataclass

from model.config import ModelConfig
from model.kv_cache import bytes_per_page
from model.kv_groups import group_window, is_hybrid, num_group_layers
from serving.core.kv_window import cdiv, request_pages


@dataclass(frozen=True)
class WindowPool:
    window: int  # the window layers' widest window
    page_size: int
    step_tokens: int  # max_num_batched_tokens
    max_num_seqs: int
    page_bytes: int  # one page of the window layers (one device's share)
    full_page_bytes: int  # one page of the full-attention layers

    @classmethod
    def of(cls, cfg: ModelConfig, device_cfg: ModelConfig, page_size: int, kv_cache_dtype,
           step_tokens: int, max_num_seqs: int) -> "WindowPool | None":
        """The pool of a hybrid model, else None. device_cfg: what one device holds."""
        if not is_hybrid(cfg):
            return None
        full, window = num_group_layers(cfg)
        return cls(group_window(cfg), page_size, step_tokens, max_num_seqs,
                   bytes_per_page(device_cfg, page_size, kv_cache_dtype, window),
                   bytes_per_page(device_cfg, page_size, kv_cache_dtype, full))

    @property
    def least_pages(self) -> int:
        """One request's window and step, and the sink page."""
        return request_pages(self.window, self.step_tokens, self.page_size) + 1

    @property
    def wanted_pages(self) -> int:
        """Every running request's window after a decode step (the keys c - W + 1 .. c
        touch at most cdiv(W - 1, page_size) + 1 pages; one more while its next page
        opens), a step's new tokens, and the sink page."""
        per_request = cdiv(self.window - 1, self.page_size) + 2
        return max(self.max_num_seqs * per_request + cdiv(self.step_tokens, self.page_size)
                   + 1, self.least_pages)

    def pages_within(self, kv_bytes: int) -> int:
        """The pool's pages (sink included) out of kv_bytes of KV memory."""
        return max(min(self.wanted_pages, kv_bytes // 2 // self.page_bytes), self.least_pages)

    def bytes(self, pages: int) -> int:
        return pages * self.page_bytes
