"""SchedulerOutput -> numpy arrays padded to a bucket: everything a step sends to the device.

Host side: numpy only, no JAX. Field names match model.batch.Batch and
serving.engine.sampler.SamplingInputs, which the runner builds from these dicts.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from serving.core.buckets import Buckets
from serving.core.grammar import step_bitmask
from serving.core.sampling_params import MAX_LOGIT_BIAS
from serving.core.request import PAD_SAMPLING_ROW, PLACEHOLDER_TOKEN, SAMPLING_ROW
from serving.core.scheduler import ScheduledRequest, SchedulerOutput
from serving.core.prompt_logprobs import wants_prompt_logprobs
from serving.core.pooling import pooling_rows

SINK_SLOT = 0  # padding tokens write to slot 0 of the reserved sink page 0


@dataclass
class StepArrays:
    shape: tuple[int, int, int]  # (tokens, requests, pages per request) bucket
    batch: dict[str, np.ndarray]
    sampling: dict[str, np.ndarray]
    wants_logprobs: bool
    # i32[T]: the prompt token each position scores (-1: none), when some row asks for
    # prompt logprobs (serving.engine.prompt_logprobs); else None
    prompt_targets: np.ndarray | None = None
    bitmask: np.ndarray | None = None  # i32[R, W] allowed tokens; None: no row constrained
    # i32[R, P * page_size] prompt + output tokens of penalised rows, -1 padded; None when no
    # row is penalised: the runner then passes a -1 array it keeps on the device, so an
    # unpenalised step never sends R x max_model_len entries.
    history: np.ndarray | None = None
    # The first sampled row of each scheduled request (it has `num_rows` of them: one per
    # proposed token it verifies, then one)
    first_rows: list[int] | None = None
    # bool[T]: the tokens whose final-normed hidden state an embedding request pools
    # (serving.engine.pooling); None when no request of the step pools
    pooling_rows: np.ndarray | None = None


def step_shape(buckets: Buckets, num_tokens: int, num_pages: int,
               max_num_seqs: int) -> tuple[int, int, int]:
    """The bucket a step runs in. The request count follows the token bucket (a step never
    has more requests than tokens or than max_num_seqs), so the shapes are tokens x pages."""
    T = buckets.pad_tokens(num_tokens)
    R = buckets.pad_requests(min(T, max_num_seqs))
    return T, R, buckets.pad_pages(max(num_pages, 1))


def all_step_shapes(buckets: Buckets, max_num_seqs: int) -> list[tuple[int, int, int]]:
    return sorted({step_shape(buckets, t, p, max_num_seqs)
                   for t in buckets.tokens for p in buckets.pages})


def prepare(out: SchedulerOutput, buckets: Buckets, page_size: int,
            max_num_seqs: int, bitmask_width: int = 0,
            pooling_type: str | None = None, lora_slots: list[int] | None = None,
            prev_rows: dict[str, int] | None = None,
            shape: tuple[int, int, int] | None = None) -> StepArrays:
    """pooling_type: an embedding engine's (core/pooling_params.py), else None.
    lora_slots: with LoRA on, each scheduled request's adapter slot (-1: none).
    prev_rows: with async scheduling, the previous step's first sampled row of each of its
    requests, for the tokens it samples that this step takes as input. shape: the bucket
    (at least the step's own), else the step's own."""
    sched = out.scheduled
    T, R, P = shape or step_shape(buckets, out.num_batched_tokens,
                                  max(len(s.page_ids) for s in sched), max_num_seqs)
    first_rows = _first_rows(sched, R)
    batch = _token_arrays(sched, T, R, P, page_size, first_rows, prev_rows)
    if lora_slots is not None:  # every token of a request uses its adapter
        batch["lora_slots"] = np.full(T, -1, np.int32)
        counts = [s.num_new_tokens for s in sched]
        batch["lora_slots"][:sum(counts)] = np.repeat(np.asarray(lora_slots, np.int32), counts)
    sampling = _sampling_arrays(out, R)
    wants = any(s.request.sampling_params.logprobs is not None for s in sched)
    history = (_history(sched, *history_shape((T, R, P), page_size))
               if sampling["any_penalty"] else None)
    targets = prompt_targets(sched, T) if any(wants_prompt_logprobs(s) for s in sched) else None
    bitmask = step_bitmask(sched, R, bitmask_width, first_rows) if bitmask_width else None
    sampling["any_masked"] = np.bool_(bitmask is not None)
    pooled = pooling_rows(sched, T, pooling_type) if pooling_type else None
    return StepArrays((T, R, P), batch, sampling, wants, prompt_targets=targets,
                      history=history, bitmask=bitmask, first_rows=first_rows,
                      pooling_rows=pooled)


def _token_arrays(sched: list[ScheduledRequest], T: int, R: int, P: int, page_size: int,
                  first_rows: list[int], prev_rows: dict[str, int] | None = None
                  ) -> dict[str, np.ndarray]:
    """The model's per-token and per-row inputs, built from flat lists with a few whole-array
    numpy operations (no per-request numpy calls: at 256 requests those were milliseconds)."""
    counts = np.array([s.num_new_tokens for s in sched], np.int32)
    n = int(counts.sum())
    req = np.repeat(np.arange(len(sched), dtype=np.int32), counts)
    offsets = np.cumsum(counts) - counts  # each request's first token in the step
    pos = (np.arange(n, dtype=np.int32) - np.repeat(offsets, counts)
           + np.repeat(np.array([s.start for s in sched], np.int32), counts))
    page_table = page_table_rows([s.page_ids for s in sched], R, P)
    input_ids = np.zeros(T, np.int32)
    input_ids[:n] = [t for s in sched for t in s.token_ids]
    positions = np.zeros(T, np.int32)
    positions[:n] = pos
    slots = slots_array(page_table, req, pos, T, page_size)
    req_indices = np.full(T, R - 1, np.int32)
    req_indices[:n] = req
    # Sampled rows: a request verifying k proposed tokens has k + 1, at its last k + 1 tokens.
    rows = np.array([s.num_rows for s in sched], np.int32)
    m = int(rows.sum())
    first = np.repeat(np.array(first_rows, np.int32), rows)
    logits_indices = np.zeros(R, np.int32)
    logits_indices[:m] = (np.repeat(offsets + counts - rows, rows)
                          + np.arange(m, dtype=np.int32) - first)
    draft_ids = np.full(R, -1, np.int32)  # the proposed token a row's sample is checked against
    row_start = np.arange(R, dtype=np.int32)  # the first row of the row's request
    row_start[:m] = first
    if any(s.spec_token_ids for s in sched):
        draft = np.array([t for s in sched for t in s.spec_token_ids + [-1]], np.int32)
        draft_ids[:m] = draft
    arrays = dict(input_ids=input_ids, positions=positions, slot_mapping=slots,
                  req_indices=req_indices, page_table=page_table, logits_indices=logits_indices,
                  draft_ids=draft_ids, row_start=row_start,
                  prev_rows=prev_rows_array(sched, input_ids, req, T, prev_rows))
    if sched[0].state_slot is not None:  # a linear-attention hybrid (model/linear_attention/)
        arrays.update(state_arrays([s.state_slot for s in sched], counts, R))
    if sched[0].window_page_ids is not None:  # a hybrid model's window layers
        window_table = page_table_rows([s.window_page_ids for s in sched], R, P)
        arrays.update(window_page_table=window_table,
                      window_slot_mapping=slots_array(window_table, req, pos, T, page_size))
    return arrays


def state_arrays(slots: list[int], counts: np.ndarray, R: int) -> dict[str, np.ndarray]:
    """Each row's state slot (padded rows: the null slot 0) and where its tokens start
    (padded rows start, and end, at the step's last real token)."""
    state_slots = np.zeros(R, np.int32)
    state_slots[:len(slots)] = slots
    query_start = np.full(R + 1, int(counts.sum()), np.int32)
    query_start[:len(slots) + 1] = np.concatenate([[0], np.cumsum(counts)])
    return dict(state_slots=state_slots, query_start=query_start)


def prev_rows_array(sched: list[ScheduledRequest], input_ids: np.ndarray, req: np.ndarray,
                    T: int, prev_rows: dict[str, int] | None) -> np.ndarray:
    """i32[T]: for each token not yet known on the host (PLACEHOLDER_TOKEN: async
    scheduling), the previous step's row that samples it; -1 for the others."""
    out = np.full(T, -1, np.int32)
    n = len(req)
    unknown = input_ids[:n] == PLACEHOLDER_TOKEN
    if unknown.any():
        if prev_rows is None:
            raise ValueError("a step with tokens still on the device needs the rows that "
                             "sample them")
        rows = np.array([prev_rows.get(s.request.request_id, -1) for s in sched], np.int32)
        out[:n] = np.where(unknown, rows[req], -1)
        if (out[:n][unknown] < 0).any():
            raise ValueError("a token still on the device has no row in the previous step")
        input_ids[:n][unknown] = 0
    return out


def page_table_rows(tables: list[list[int]], R: int, P: int) -> np.ndarray:
    """i32[R, P]: row i holds tables[i]'s pages, then zeros (the sink page)."""
    page_table = np.zeros((R, P), np.int32)
    widths = np.array([len(t) for t in tables], np.int32)
    page_table[np.repeat(np.arange(len(tables)), widths),
               np.arange(int(widths.sum())) - np.repeat(np.cumsum(widths) - widths, widths)] = \
        [p for t in tables for p in t]
    return page_table


def slots_array(page_table: np.ndarray, req: np.ndarray, pos: np.ndarray, T: int,
                page_size: int) -> np.ndarray:
    """Each token's cache slot (page * page_size + offset); padding writes to the sink."""
    slots = np.full(T, SINK_SLOT, np.int32)
    slots[:len(pos)] = page_table[req, pos // page_size] * page_size + pos % page_size
    return slots


def _first_rows(sched: list[ScheduledRequest], R: int) -> list[int]:
    rows = np.cumsum([0] + [s.num_rows for s in sched]).tolist()
    if rows[-1] > R:
        raise ValueError(f"{rows[-1]} sampled rows do not fit a step of {R} requests")
    return rows[:-1]


def _rows(sched: list[ScheduledRequest]):
    """(scheduled request, its j-th sampled row) for every sampled row, in row order."""
    return [(s, j) for s in sched for j in range(s.num_rows)]


def padding_step(shape: tuple[int, int, int], hybrid: bool = False,
                 linear: bool = False) -> StepArrays:
    """A step of the given shape made only of padding (for compiling it). hybrid: with the
    window layers' page table too (model/kv_groups.py); linear: with the state slots of a
    linear-attention hybrid (model/linear_attention/)."""
    T, R, P = shape
    batch = dict(input_ids=np.zeros(T, np.int32), positions=np.zeros(T, np.int32),
                 slot_mapping=np.full(T, SINK_SLOT, np.int32),
                 req_indices=np.full(T, R - 1, np.int32), page_table=np.zeros((R, P), np.int32),
                 logits_indices=np.zeros(R, np.int32), draft_ids=np.full(R, -1, np.int32),
                 row_start=np.arange(R, dtype=np.int32), prev_rows=np.full(T, -1, np.int32))
    if hybrid:
        batch.update(window_page_table=np.zeros((R, P), np.int32),
                     window_slot_mapping=np.full(T, SINK_SLOT, np.int32))
    if linear:
        batch.update(state_arrays([], np.zeros(0, np.int32), R))
    sampling = _sampling_arrays(SchedulerOutput(), R)
    sampling["any_masked"] = np.bool_(False)
    return StepArrays(shape, batch, sampling, False)


def history_shape(shape: tuple[int, int, int], page_size: int) -> tuple[int, int]:
    """(R, S): S = pages per request x page size covers the longest request."""
    _, R, P = shape
    return R, P * page_size


_NEUTRAL = np.frombuffer(PAD_SAMPLING_ROW, "<f8")  # greedy, unfiltered, unpenalised


def _columns(first: str, last: str) -> slice:
    """Request.sampling_row's columns from `first` to `last` (SAMPLING_ROW's order)."""
    return slice(SAMPLING_ROW.index(first), SAMPLING_ROW.index(last) + 1)


_FLOATS = _columns("temperature", "min_p")  # the float32 arrays
_PENALTIES = _columns("repetition_penalty", "frequency_penalty")
_FILTERS = _columns("top_p", "top_k")
_TEMPERATURE, _TOP_K, _SEED, _NUM_PROMPT, _HAS_BIAS, _HAS_LOGPROBS = map(SAMPLING_ROW.index, (
    "temperature", "top_k", "seed", "num_prompt", "has_bias", "has_logprobs"))


def _sampling_arrays(out: SchedulerOutput, R: int) -> dict[str, np.ndarray]:
    """Every row's sampling values from one table of the requests' fixed rows
    (Request.sampling_row, built once per request): a few whole-table numpy operations a
    step, not one Python pass per value."""
    rows = _rows(out.scheduled)
    pad = R - len(rows)
    table = np.frombuffer(b"".join([s.request.sampling_row for s, _ in rows]
                                   + [PAD_SAMPLING_ROW] * pad), "<f8").reshape(R, -1).T
    floats = table[_FLOATS].astype(np.float32)
    output_index = np.zeros(R, np.int32)
    output_index[:len(rows)] = [s.request.num_output_tokens + j for s, j in rows]
    arrays = dict(zip(SAMPLING_ROW[_FLOATS], floats), top_k=table[_TOP_K].astype(np.int32),
                  seed=table[_SEED].astype(np.uint32), output_index=output_index,
                  num_prompt=table[_NUM_PROMPT].astype(np.int32))
    # The flags: which columns hold a value other than the neutral one padding rows send
    # (a row is random when its temperature is not 0, filtered when top-k, top-p or min-p
    # is set, which validation allows only one way from the neutral value).
    set_ = table != _NEUTRAL[:, None]  # bool[F, R]
    some = set_.any(axis=1)
    any_bias = bool(some[_HAS_BIAS])
    # Only biased steps pay for these arrays; others send placeholders of a fixed shape so
    # the program does not change.
    arrays["bias_ids"], arrays["bias_values"] = (
        _bias([s.request.sampling_params for s, _ in rows], R) if any_bias
        else (_placeholder((R, MAX_LOGIT_BIAS)), np.zeros((R, MAX_LOGIT_BIAS), np.float32)))
    arrays.update(
        any_penalty=np.bool_(some[_PENALTIES].any()), any_bias=np.bool_(any_bias),
        any_filter=np.bool_((set_[_FILTERS].any(axis=0) & set_[_TEMPERATURE]).any()),
        any_random=np.bool_(some[_TEMPERATURE]), any_logprobs=np.bool_(some[_HAS_LOGPROBS]))
    return arrays


_placeholders: dict[tuple[int, int], np.ndarray] = {}


def _placeholder(shape: tuple[int, int]) -> np.ndarray:
    if shape not in _placeholders:
        _placeholders[shape] = np.full(shape, -1, np.int32)
    return _placeholders[shape]


def _history(sched, R: int, S: int) -> np.ndarray:
    """A row verifying the j-th proposed token sees the j before it as outputs."""
    history = np.full((R, S), -1, np.int32)
    for i, (s, j) in enumerate(_rows(sched)):
        if s.request.sampling_params.uses_penalties:
            tokens = (s.request.all_token_ids + s.spec_token_ids[:j])[:S]
            history[i, :len(tokens)] = tokens
    return history


def _bias(params, R: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.full((R, MAX_LOGIT_BIAS), -1, np.int32)
    values = np.zeros((R, MAX_LOGIT_BIAS), np.float32)
    for i, p in enumerate(params):
        for j, (token, value) in enumerate(p.logit_bias.items()):
            ids[i, j], values[i, j] = token, value
    return ids, values


def prompt_targets(sched: list[ScheduledRequest], T: int) -> np.ndarray:
    """-> i32[T]: for each token of the step, the prompt token after it when its request
    asks for prompt logprobs, else -1."""
    targets = np.full(T, -1, np.int32)
    t = 0
    for s in sched:
        if wants_prompt_logprobs(s):
            prompt = s.request.prompt_token_ids
            m = min(s.num_new_tokens, len(prompt) - 1 - s.start)
            targets[t:t + m] = prompt[s.start + 1:s.start + 1 + m]
        t += s.num_new_tokens
    return targets
