"""The draft-model proposer, host side: what the draft model computes for each request that
may verify, in chunks that fit a step's token budget, and the pages its look-ahead writes.
Plain Python, no JAX: the device work is `run`, a callable the engine passes
(serving/engine/draft_model.py).

The draft model keeps its own KV cache, addressed with the target's page ids (same page
size), so it needs no allocator: a request's pages hold the target's K/V in one cache and the
draft's in the other. Per request the proposer remembers how many leading positions of the
draft's cache are right (`valid`). It never trusts a page it has not written for this request
(a prefix-cache hit holds the target's K/V only), and a preempted request (new pages) starts
over. A call, for a request of L tokens whose last one the target has not computed yet:

1. catches up: the draft computes positions valid .. L - 1 (all of them after the prompt's
   prefill or after a long run above disable_by_batch_size, one or two after a verifying
   step), chunked so that a call's rows fit the largest token bucket;
2. proposes: from the last position's logits its greedy token d1, then k - 1 decode steps on
   its own tokens, writing d1 .. d(k-1) at positions L .. L + k - 2. Those pages are
   allocated here; the next step, verifying d1 .. dk, needs them anyway.

The look-ahead K/V stays right for the proposed tokens the target accepts: the next call
compares the proposal with the tokens the request got, up to num_computed_tokens (pages past
it may have been given back), and catches up from there.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from serving.core.kv_cache_manager import KVCacheManager
from serving.core.request import Request


@dataclass
class DraftRow:
    """One request's share of a draft call."""
    request: Request
    start: int  # position of token_ids[0]
    token_ids: list[int]  # the tokens the draft computes: positions start .. start + n - 1
    page_ids: list[int]  # the request's page table (covers the look-ahead too)
    num_lookahead: int  # decode steps after d1 (k_r - 1); -1: catch up only, propose nothing

    @property
    def proposes(self) -> bool:
        return self.num_lookahead >= 0


@dataclass
class _DraftState:
    request: Request
    num_preemptions: int
    valid: int = 0  # leading positions whose draft K/V is right
    proposal_start: int = -1  # position of proposal[0]
    proposal: list[int] = field(default_factory=list)


# rows -> per row its proposed tokens (num_lookahead + 1 of them; [] for a catch-up row)
RunDraft = Callable[[list[DraftRow]], list[list[int]]]


class DraftProposer:
    def __init__(self, num_speculative_tokens: int, kv_cache_manager: KVCacheManager,
                 run: RunDraft, max_tokens_per_call: int, max_len: int):
        self.k = num_speculative_tokens
        self.kv = kv_cache_manager
        self.run = run
        self.max_tokens_per_call = max_tokens_per_call
        self.max_len = max_len
        self._states: dict[str, _DraftState] = {}
        self.num_calls = 0  # device calls, catch-up chunks included

    def propose(self, requests: list[Request]) -> None:
        """Sets each request's spec_token_ids for its next step (every request here has all
        but its last token computed by the target)."""
        self._forget_finished()
        work = []
        for req in requests:
            req.spec_token_ids = []
            k = min(self.k, req.max_tokens - req.num_output_tokens - 1,
                    self.max_len - req.num_tokens - 1)
            if k < 1 or not self.kv.allocate_slots(req, k):
                continue  # short of pages: no proposal this step, before anyone is preempted
            st = self._state(req)
            if st.valid == req.num_tokens and st.proposal_start == req.num_tokens:
                req.spec_token_ids = st.proposal[:k]  # not scheduled since: still the guess
                continue
            work.append((req, st, k))
        while work:
            rows, used = [], 0
            for req, st, k in work:
                take = min(req.num_tokens - st.valid, self.max_tokens_per_call - used)
                if take < 1:
                    break
                final = st.valid + take == req.num_tokens
                rows.append(DraftRow(req, st.valid, req.slice_token_ids(st.valid,
                                                                        st.valid + take),
                                     list(self.kv.page_ids(req.request_id)),
                                     k - 1 if final else -1))
                used += take
            if not rows:  # cannot happen while `valid` is right; never loop on it
                raise RuntimeError("the draft model's cache claims a whole request")
            self.num_calls += 1
            left = []
            for row, tokens, (req, st, k) in zip(rows, self.run(rows), work):
                st.valid = row.start + len(row.token_ids)
                if not row.proposes:
                    left.append((req, st, k))
                    continue
                if len(tokens) != k:
                    raise ValueError(f"the draft model proposed {len(tokens)} tokens, not {k}")
                st.proposal_start, st.proposal = req.num_tokens, list(tokens)
                req.spec_token_ids = list(tokens)
            work = left + work[len(rows):]

    def _state(self, req: Request) -> _DraftState:
        st = self._states.get(req.request_id)
        if st is None or st.request is not req or st.num_preemptions != req.num_preemptions:
            st = self._states[req.request_id] = _DraftState(req, req.num_preemptions)
            return st
        # The look-ahead K/V (proposal[:-1] at proposal_start ..) is right where the request
        # got those very tokens, within the positions the target has computed.
        if st.proposal_start == st.valid:
            got = req.slice_token_ids(st.valid, req.num_computed_tokens)
            m = 0
            for a, b in zip(st.proposal[:-1], got):
                if a != b:
                    break
                m += 1
            st.valid += m
        return st

    def _forget_finished(self) -> None:
        for rid in [r for r, st in self._states.items() if st.request.is_finished]:
            del self._states[rid]

    @property
    def num_tracked(self) -> int:
        return len(self._states)
