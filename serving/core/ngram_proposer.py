"""The n-gram (prompt lookup) proposer: the longest suffix of a request's tokens (prompt and
output), between prompt_lookup_min and prompt_lookup_max tokens long, that occurred earlier
proposes the tokens that followed its latest earlier occurrence. Host only: numpy, no JAX."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from serving.core.request import Request


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """tokens: int[L] -> at most k proposed next tokens (none when no suffix recurs)."""
    L = len(tokens)
    if k < 1 or L < min_n + 1:
        return []
    last = tokens[-1]
    # Candidate ends: earlier positions holding the last token, newest first.
    ends = np.flatnonzero(tokens[:-1] == last)[::-1]
    if len(ends) == 0:
        return []
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n:]
        starts = ends[ends >= n - 1] - (n - 1)
        if len(starts) == 0:
            continue
        windows = sliding_window_view(tokens, n)[starts]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            follow = starts[hits[0]] + n  # the newest match's next token
            return tokens[follow:follow + k].tolist()
    return []


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, requests: list[Request]) -> None:
        """Sets each request's spec_token_ids for its next step."""
        for req in requests:
            tokens = np.asarray(req.all_token_ids, np.int64)
            req.spec_token_ids = propose_ngram(tokens, self.k, self.min_n, self.max_n)
