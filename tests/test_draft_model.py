"""Speculative decoding with a draft model (docs/architecture.md, "Speculative decoding"):
the same tokens as without speculation for greedy and seeded requests, with a tiny draft
that mostly agrees with a tiny target and with the demo model drafting for itself (then
every proposed token is accepted); the draft's cache always holds the tokens it proposes
from (a host simulation, preemption included); pages come back; bad drafts are clear
errors; nothing compiles after warm-up."""
from __future__ import annotations

import copy
import json
import random
import shutil

import pytest
import torch

from model.checkpoint import convert_hf
from model.config import ModelConfig
from model.kv_cache import bytes_per_page
from serving import LLM, SamplingParams
from serving.core.draft_proposer import DraftProposer
from serving.core.request import Request
from serving.core.scheduler import Scheduler, SchedulerConfig
from serving.core.spec_config import SpeculativeConfig
from serving.core.spec_decode import Drafter
from tests.demo_engine import DEMO_OPTIONS, greedy
from tests.hf_tiny import tiny_hf_model
from tests.test_engine import (PREEMPT_OPTIONS, PREEMPT_PAGES, TINY_OPTIONS,  # noqa: F401
                               tiny_model, torch_one_thread)
from tests.test_spec_decode import accepted, check_same, repetitive_prompts, run


def draft_spec(model, k=3, **kwargs):
    return dict(method="draft_model", model=str(model), num_speculative_tokens=k,
                disable_by_batch_size=16, **kwargs)


def save_checkpoint(hf_model, hf_dir, tokenizer_from):
    hf_model.save_pretrained(hf_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_from / name, hf_dir / name)
    ckpt = hf_dir.with_name(hf_dir.name + "-ckpt")
    convert_hf(hf_dir, ckpt, "float32", progress=False)
    return ckpt


@pytest.fixture(scope="module")
def tiny_draft(tiny_model, tmp_path_factory, demo_model_dir):  # noqa: F811
    """The tiny target's weights with noise added: a draft that is right most of the time
    and wrong often enough that rejections run too."""
    draft = copy.deepcopy(tiny_model[0])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1 * p.std())
    return save_checkpoint(draft, tmp_path_factory.mktemp("tiny-draft"), demo_model_dir)


@pytest.fixture(scope="module")
def tiny_off(tiny_model):  # noqa: F811
    return LLM(str(tiny_model[1]), **TINY_OPTIONS)


@pytest.fixture(scope="module")
def tiny_on(tiny_model, tiny_draft):  # noqa: F811
    return LLM(str(tiny_model[1]), speculative_config=draft_spec(tiny_draft), **TINY_OPTIONS)


def pages_all_free(llm: LLM) -> bool:
    alloc = llm.engine.scheduler.allocator
    return alloc.num_used_pages == 0 and alloc.num_free_pages == alloc.num_usable_pages


# -- bad drafts --------------------------------------------------------------------------------

def test_a_missing_draft_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        SpeculativeConfig.parse(draft_spec(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="needs 'model'"):
        SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 2})


def test_an_incompatible_draft_is_a_clear_error(tiny_model, tiny_draft, tmp_path):  # noqa: F811
    other_tok = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_draft, other_tok)
    tok = json.loads((other_tok / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids
    (other_tok / "tokenizer.json").write_text(json.dumps(tok))
    small_vocab = tmp_path / "small-vocab"
    shutil.copytree(tiny_draft, small_vocab)
    cfg = json.loads((small_vocab / "config.json").read_text())
    (small_vocab / "config.json").write_text(json.dumps({**cfg, "vocab_size": 150}))
    no_tok = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_draft, no_tok)
    (no_tok / "tokenizer.json").unlink()
    short = tmp_path / "short"
    tiny_hf_model("llama", short, max_position_embeddings=64)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tiny_draft / name, short / name)
    for folder, message in ((other_tok, "another tokenizer"), (small_vocab, "embeds 150"),
                            (no_tok, "has no tokenizer"), (short, "context of 64")):
        with pytest.raises(ValueError, match=message):
            LLM(str(tiny_model[1]), speculative_config=draft_spec(folder), **TINY_OPTIONS)


# -- the engine --------------------------------------------------------------------------------

def test_greedy_is_the_same_with_a_draft_model_tiny(tiny_off, tiny_on):
    engine = tiny_on.engine
    programs = engine.draft.num_compiled
    assert programs == len(engine.draft.shapes) == 6  # 3 token x 2 page buckets
    assert engine.warmup_report.programs == len(engine.step_shapes) + 1 + programs
    prompts = repetitive_prompts(random.Random(11), 10)
    before = accepted(tiny_on)
    check_same(run(tiny_off, prompts, greedy(24)), run(tiny_on, prompts, greedy(24)))
    drafts, proposed, kept = (a - b for a, b in zip(accepted(tiny_on), before))
    assert drafts > 10 and 0.2 * proposed < kept < proposed, (drafts, proposed, kept)
    assert pages_all_free(tiny_on)
    assert engine.drafter.proposer.num_tracked == 0
    assert engine.draft.num_compiled == programs and engine.runner.num_compiled == len(
        engine.step_shapes)


def test_seeded_sampling_is_the_same_with_a_draft_model(tiny_off, tiny_on):
    prompts = repetitive_prompts(random.Random(12), 6)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=5, seed=8, max_tokens=20, logprobs=2,
                       ignore_eos=True),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=20,
                       ignore_eos=True),
        SamplingParams(temperature=0.7, seed=9, n=2, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.5, seed=11, max_tokens=20, stop_token_ids=[17, 33]),
        SamplingParams(temperature=0.3, seed=12, max_tokens=20, ignore_eos=True),
    ]
    before = accepted(tiny_on)
    check_same(run(tiny_off, prompts, params), run(tiny_on, prompts, params))
    assert accepted(tiny_on)[2] > before[2]
    assert pages_all_free(tiny_on)


def test_preempted_requests_keep_their_tokens_with_a_draft_model(tiny_model,  # noqa: F811
                                                                   tiny_draft):
    cfg = ModelConfig.from_dir(tiny_model[1])
    page = 2 * bytes_per_page(cfg, PREEMPT_OPTIONS["page_size"])  # target and draft caches
    options = dict(PREEMPT_OPTIONS, kv_cache_memory=PREEMPT_PAGES * page)
    on = LLM(str(tiny_model[1]), speculative_config=draft_spec(tiny_draft), **options)
    off = LLM(str(tiny_model[1]), **options)
    rng = random.Random(13)
    prompts = [[rng.randrange(3, 211) for _ in range(n)] for n in (6, 20, 11, 3, 15, 9)]
    params = [greedy(40), greedy(36), greedy(33), greedy(45), greedy(30), greedy(38)]
    check_same(run(off, prompts, params), run(on, prompts, params))
    assert on.engine.scheduler.num_preemptions_total > 0
    assert accepted(on)[2] > 0 and pages_all_free(on)


def test_the_demo_model_drafting_for_itself_accepts_every_token(demo_checkpoint, demo_llm):
    off = demo_llm
    on = LLM(str(demo_checkpoint), speculative_config=draft_spec(demo_checkpoint, k=4),
             **DEMO_OPTIONS)
    prompts = [off.tokenizer.encode(p) for p in (
        "Repeat this sentence: the quick brown fox jumps over the lazy dog.", "Hello",
        "def add(a, b):\n", "List three fruits:")]
    check_same(run(off, prompts, greedy(40)), run(on, prompts, greedy(40)))
    drafts, proposed, kept = accepted(on)
    assert drafts > 20 and kept == proposed, (drafts, proposed, kept)
    assert pages_all_free(on)


# -- the host side, simulated ------------------------------------------------------------------

V = 37


def target_next(context) -> int:
    """A deterministic "target model": the next token of a context."""
    return (sum((i + 1) * t for i, t in enumerate(context[-3:])) * 7 + len(context)) % V


class FakeDraft:
    """A draft model on a dict cache (slot -> the token and position written there). A call
    checks that every position a row attends to holds the request's token, then proposes the
    target's next token, wrong one time in three."""

    def __init__(self, page_size):
        self.ps, self.slots, self.rng = page_size, {}, random.Random(0)

    def slot(self, row, pos):
        return row.page_ids[pos // self.ps] * self.ps + pos % self.ps

    def run(self, rows):
        out = []
        for row in rows:
            req, context = row.request, row.request.slice_token_ids(0, row.start)
            for pos, token in enumerate(context):
                assert self.slots.get(self.slot(row, pos)) == (token, pos), (req.request_id, pos)
            for j, token in enumerate(row.token_ids):
                self.slots[self.slot(row, row.start + j)] = (token, row.start + j)
            if not row.proposes:
                out.append([])
                continue
            tokens, context = [], context + row.token_ids
            for j in range(row.num_lookahead + 1):
                guess = target_next(context)
                if self.rng.random() < 1 / 3:
                    guess = (guess + 1) % V
                tokens.append(guess)
                if j < row.num_lookahead:  # its K/V, written at the next position
                    self.slots[self.slot(row, len(context))] = (guess, len(context))
                context = context + [guess]
            out.append(tokens)
        return out


def test_the_draft_cache_holds_every_token_it_proposes_from():
    """Scheduler, page accounting and the draft proposer together, the device replaced by
    target_next and FakeDraft: few pages (preemptions), prefix-cache hits (shared prompts),
    short and long outputs."""
    cfg = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=16, max_model_len=80,
                          page_size=4, num_pages=24)
    sched = Scheduler(cfg)
    draft = FakeDraft(cfg.page_size)
    spec = SpeculativeConfig("draft_model", 3, model=".", disable_by_batch_size=6)
    proposer = DraftProposer(3, sched.kv_cache_manager, draft.run, 16, sched.max_len)
    drafter = Drafter(spec, proposer)
    rng = random.Random(1)
    shared = [rng.randrange(V) for _ in range(9)]
    reqs = [Request(f"r{i}", (shared if i % 2 else []) + [rng.randrange(V) for _ in range(
        rng.randint(2, 14))], SamplingParams(temperature=0.0, max_tokens=rng.randint(5, 50),
                                             ignore_eos=True), frozenset(), seed=0)
            for i in range(10)]
    for r in reqs:
        sched.add_request(r)
    steps = 0
    while sched.has_unfinished:
        out = sched.schedule()
        sampled = []
        for s in out.scheduled:
            req, tokens = s.request, []
            if not s.samples:
                sampled.append(None)
                continue
            context = req.all_token_ids
            for d in s.spec_token_ids + [None]:
                tokens.append(target_next(context))
                if tokens[-1] != d:
                    break
                context = context + [d]
            sampled.append(tokens if s.spec_token_ids else tokens[0])
        sched.update(out, sampled)
        drafter.propose(sched.running)
        steps += 1
        assert steps < 2000
    for r in reqs:
        want = list(r.prompt_token_ids)
        for _ in range(r.sampling_params.max_tokens):
            want.append(target_next(want))
        assert r.output_token_ids == want[r.num_prompt_tokens:], r.request_id
    stats = sched.spec_stats
    assert sched.num_preemptions_total > 0 and sched.kv_cache_manager.prefix_cache_hits > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert sched.allocator.num_used_pages == 0 and proposer.num_tracked == 0
    assert proposer.num_calls > stats.num_drafts * 0.5
