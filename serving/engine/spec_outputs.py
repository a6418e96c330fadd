"""A step's results as the scheduler and the detokenizer take them, when a request may get
several tokens in one step (speculative decoding verified some of its proposed tokens).
Host side, numpy only."""
from __future__ import annotations

import numpy as np

from serving.core.scheduler import SchedulerOutput


def emitted_tokens(out: SchedulerOutput, first_rows: list[int], result) -> list:
    """Per scheduled request: None (a prefill chunk that samples nothing), its token, or
    (verifying proposed tokens) the list of its rows' tokens the device emitted."""
    tokens, emitted = result.tokens, result.emitted
    sampled = []
    for s, r in zip(out.scheduled, first_rows):
        if not s.samples:
            sampled.append(None)
        elif s.spec_token_ids:
            rows = slice(r, r + s.num_rows)
            sampled.append(tokens[rows][np.asarray(emitted[rows], bool)].tolist())
        else:
            sampled.append(int(tokens[r]))
    return sampled


def feed_until_stop(detokenizer, new_ids: list[int]) -> tuple[str, str | None, list[int]]:
    """Feeds the detokenizer one token at a time, as a step without speculation would, and
    stops at a stop string. -> (new text, the stop string or None, the ids taken)."""
    if len(new_ids) <= 1:
        text, stop = detokenizer.add(new_ids)
        return text, stop, new_ids
    texts = []
    for j, token in enumerate(new_ids):
        text, stop = detokenizer.add([token])
        texts.append(text)
        if stop is not None:
            return "".join(texts), stop, new_ids[:j + 1]
    return "".join(texts), None, new_ids
