"""LoRA adapters served in one batch: greedy tokens equal transformers + peft (and the merged
model) row by row, for two families, with base-only rows and more adapters than slots."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from model import lora
from model.batch import sequences_batch
from model.checkpoint import load_model
from model.kv_cache import KVCache
from model.runtime_params import prepare_params
from model.transformer import forward
from serving import LLM, LoRARequest, SamplingParams
from serving.lora.peft import load_adapter
from serving.lora.request import LoRAError
from tests.hf_tiny import greedy_reference, tiny_hf_model
from tests.lora_tiny import ADAPTERS, make_adapter

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [(7 * i) % 200 + 3 for i in range(37)]]
# Default buckets; two slots for three adapters, so the scheduler holds some back.
OPTIONS = dict(enable_lora=True, max_loras=2, max_lora_rank=16, max_model_len=128,
               max_num_seqs=8, progress=False)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"lora_{request.param}")
    base = tiny_hf_model(request.param, folder / "base")
    adapters, refs = {}, {None: [greedy_reference(base, p, MAX_TOKENS) for p in PROMPTS]}
    for i, name in enumerate(ADAPTERS):
        model = make_adapter(base, name, folder / name, seed=i)
        adapters[name] = (folder / name, model)
        refs[name] = [greedy_reference(model, p, MAX_TOKENS) for p in PROMPTS]
    llm = LLM(str(folder / "base"), **OPTIONS)
    return base, adapters, refs, llm


def lora_requests(adapters):
    return {name: LoRARequest(name, i + 1, str(path))
            for i, (name, (path, _)) in enumerate(adapters.items())}


def test_mixed_batch_matches_peft_row_by_row(family):
    base, adapters, refs, llm = family
    by_name = lora_requests(adapters)
    rows = [(name, i) for i in range(len(PROMPTS)) for name in ["sql", None, "poet", "chat"]]
    seen = []
    step_slots = llm.engine.lora.step_slots
    llm.engine.lora.step_slots = lambda a: (seen.append({x.digest for x in a if x}),
                                            step_slots(a))[1]
    try:
        out = llm.generate([PROMPTS[i] for _, i in rows], GREEDY,
                           lora_request=[by_name.get(name) for name, _ in rows])
    finally:
        llm.engine.lora.step_slots = step_slots
    for (name, i), result in zip(rows, out):
        assert result.token_ids == refs[name][i], (name, i)
    # the adapters change the answers (a tiny model's greedy loop may hide one of them),
    # and never more than two run in one step
    assert sum(refs[name] != refs[None] for name in ADAPTERS) >= 2
    assert max(len(s) for s in seen) == 2
    assert len(set().union(*seen)) == 3


def test_merged_model_gives_the_same_tokens(family):
    base, adapters, refs, llm = family
    merged = adapters["chat"][1].merge_and_unload()
    assert [greedy_reference(merged, p, MAX_TOKENS) for p in PROMPTS] == refs["chat"]
    got = llm.generate(PROMPTS, GREEDY, lora_request=lora_requests(adapters)["chat"])
    assert [r.token_ids for r in got] == refs["chat"]


def test_batched_equals_alone(family):
    base, adapters, refs, llm = family
    by_name = lora_requests(adapters)
    rows = [("poet", 2), (None, 0), ("poet", 1), ("sql", 2), (None, 2)]
    batched = llm.generate([PROMPTS[i] for _, i in rows], GREEDY,
                           lora_request=[by_name.get(n) for n, _ in rows])
    for (name, i), result in zip(rows, batched):
        alone = llm.generate([PROMPTS[i]], GREEDY, lora_request=by_name.get(name))
        assert result.token_ids == alone[0].token_ids == refs[name][i]


@pytest.mark.jax_cache
def test_logits_match_peft(tmp_path):
    """The model with one adapter's slot, every token's logits against peft's, float32."""
    base = tiny_hf_model("llama", tmp_path / "base")
    peft_model = make_adapter(base, "sql", tmp_path / "sql", seed=3)
    cfg, params = load_model(tmp_path / "base", progress=False)
    params = prepare_params(params)
    sites = [lora.sites(cfg, layer) for layer in params["layers"]]
    adapter = load_adapter(tmp_path / "sql", [{p for s in x for p in s.parts} for x in sites], 16)
    slots = lora.empty_slots(sites, 3, 16, cfg.dtype)
    slots = lora.write_slot(slots, np.int32(1), lora.slot_arrays(sites, adapter.weights, 16,
                                                                 cfg.dtype))
    prompts = [PROMPTS[0], PROMPTS[2]]
    table = np.arange(1, 1 + 2 * 12, dtype=np.int32).reshape(2, 12)
    batch = sequences_batch(prompts, table, 4)
    batch.lora_slots = np.array([1] * len(prompts[0]) + [-1] * len(prompts[1]), np.int32)
    logits, _ = jax.jit(forward, static_argnums=3)(
        params, KVCache.zeros(cfg, 1 + table.size, 4), jax.tree.map(jnp.asarray, batch), cfg,
        lora_slots=slots)
    logits = np.asarray(logits)
    with torch.no_grad():
        want = [m(torch.tensor([p])).logits[0].numpy()
                for m, p in ((peft_model, prompts[0]), (base, prompts[1]))]
    n = len(prompts[0])
    for got, ref in ((logits[:n], want[0]), (logits[n:], want[1])):
        assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4


def test_refusals(family, tmp_path):
    base, adapters, refs, llm = family
    with pytest.raises(LoRAError, match="no adapter_config.json"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("x", 9, str(tmp_path)))
    with pytest.raises(ValueError, match="2 LoRA requests for 1 prompts"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=[None, None])
    assert not llm.engine.has_unfinished


def test_grouped_kernel_and_ragged_dot_paths_agree(monkeypatch, tmp_path):
    """The slots in the CPU kernel's panel order (the default here) and plain for
    `ragged_dot` (other devices) give the same logits, adapters mixed with the base."""
    base = tiny_hf_model("llama", tmp_path / "base")
    make_adapter(base, "sql", tmp_path / "sql", seed=4)
    make_adapter(base, "chat", tmp_path / "chat", seed=5)
    cfg, params = load_model(tmp_path / "base", progress=False)
    params = prepare_params(params)
    sites = [lora.sites(cfg, layer) for layer in params["layers"]]
    available = [{p for s in x for p in s.parts} for x in sites]
    table = np.arange(1, 1 + 3 * 12, dtype=np.int32).reshape(3, 12)
    batch = sequences_batch(PROMPTS, table, 4)
    batch.lora_slots = np.repeat(np.array([2, -1, 0], np.int32), [len(p) for p in PROMPTS])
    batch = jax.tree.map(jnp.asarray, batch)
    logits = []
    for kernels in (True, False):
        monkeypatch.setattr(lora, "packed", lambda: kernels)
        slots = lora.empty_slots(sites, 3, 16, cfg.dtype)
        for slot, name in ((0, "sql"), (2, "chat")):
            weights = load_adapter(tmp_path / name, available, 16).weights
            slots = lora.write_slot.__wrapped__(slots, slot, lora.slot_arrays(
                sites, weights, 16, cfg.dtype))
        out, _ = forward(params, KVCache.zeros(cfg, 1 + table.size, 4), batch, cfg,
                         lora_slots=slots)
        logits.append(np.asarray(out))
    assert np.abs(logits[0] - logits[1]).max() < 1e-4
    assert np.abs(logits[0]).max() > 0.1
