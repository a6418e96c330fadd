"""Speculative decoding on the host: how many proposed tokens a request verifies in a step,
and the counters of what was proposed and accepted (vLLM's spec_decode metrics). No JAX."""
from __future__ import annotations

from dataclasses import dataclass, field

from serving.core.ngram_proposer import NgramProposer
from serving.core.request import Request
from serving.core.spec_config import SpeculativeConfig


def num_drafts(req: Request, n: int, budget: int, spare_rows: int, max_len: int) -> int:
    """Proposed tokens req verifies this step, scheduled with n tokens of its own: only a
    decode step (one new token) verifies, within the token budget, within the sampled rows
    left (a step samples at most max_num_seqs rows), and never past max_tokens or max_len
    (each accepted token is an output; the bonus token follows the last one)."""
    drafts = req.spec_token_ids
    if not drafts or n != 1 or req.num_computed_tokens != req.num_tokens - 1:
        return 0
    return max(0, min(len(drafts), budget - n, spare_rows,
                      req.max_tokens - req.num_output_tokens - 1,
                      max_len - req.num_tokens - 1))


def check_verified(spec_token_ids: list[int], tokens: list[int]) -> int:
    """tokens: what a verifying step emitted for one request (the accepted proposed tokens,
    then the target's own token). -> how many proposed tokens were accepted."""
    k = len(spec_token_ids)
    if not 1 <= len(tokens) <= k + 1:
        raise ValueError(f"a step verifying {k} proposed tokens emitted {len(tokens)}")
    accepted = len(tokens) - 1
    if tokens[:accepted] != spec_token_ids[:accepted]:
        raise ValueError("the accepted tokens are not a prefix of the proposal")
    return accepted


@dataclass
class SpecDecodeStats:
    """Running totals: requests-steps that verified a proposal, tokens proposed, tokens
    accepted, and accepted tokens by position in the proposal."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_proposed:
            self.accepted_per_pos += [0] * (num_proposed - len(self.accepted_per_pos))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def snapshot(self) -> "SpecDecodeStats":
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens,
                               self.num_accepted_tokens, list(self.accepted_per_pos))


class Drafter:
    """Asks the proposer for the next step's tokens of the running requests that may verify
    some: none while more than disable_by_batch_size requests run (a step that is no longer
    bound by reading the weights pays for every verified token), none for a constrained
    request (structured output, or min_tokens not reached: its bitmask covers one position)."""

    def __init__(self, config: SpeculativeConfig, proposer=None):
        """proposer: anything with propose(requests) setting their spec_token_ids (the
        draft model's, serving/core/draft_proposer.py); default: n-gram lookup."""
        self.config = config
        self.proposer = proposer or NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, running: list[Request]) -> None:
        if len(running) > self.config.disable_by_batch_size:
            return
        self.proposer.propose([r for r in running if may_verify(r)])


def may_verify(req: Request) -> bool:
    return (req.grammar is None and req.num_output_tokens >= req.sampling_params.min_tokens
            and req.num_computed_tokens == req.num_tokens - 1)
