"""The host side of LoRA, no engine: PEFT folders parsed and refused, the manager's slots and
LRU, the scheduler's adapter limit, the page hashes keyed by adapter, the flags."""
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from serving.core.request import Request
from serving.core.sampling_params import SamplingParams
from serving.lora.manager import LoRAManager
from serving.lora.peft import load_adapter
from serving.lora.request import LoRAConfig, LoRAError, LoRAModule, LoRARequest
from tests.hf_tiny import tiny_hf_model
from tests.lora_tiny import ALL, make_adapter
from tests.test_scheduler import make_request, make_scheduler, step

LAYERS = 3
EVERY = [set(ALL)] * LAYERS


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_host")
    base = tiny_hf_model("llama", root / "base")
    for i, name in enumerate(("sql", "poet", "chat")):
        make_adapter(base, name, root / name, seed=i)
    return root


def edited(folders, tmp_path, name, **config):
    """A copy of adapter `name` with config keys replaced."""
    out = tmp_path / f"{name}_edited"
    out.mkdir()
    cfg = {**json.loads((folders / name / "adapter_config.json").read_text()), **config}
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    (out / "adapter_model.safetensors").write_bytes(
        (folders / name / "adapter_model.safetensors").read_bytes())
    return out


def test_scales_ranks_and_patterns(folders):
    chat = load_adapter(folders / "chat", EVERY, 16)
    a, b, scale = chat.weights[(0, "o_proj")]
    assert a.shape == (2, 72) and b.shape == (72, 2) and scale == 24 / 2  # rank_pattern
    assert chat.weights[(1, "gate_proj")][2] == 5 / 16  # alpha_pattern
    assert chat.weights[(2, "q_proj")][2] == 24 / 16 and chat.rank == 16
    assert (0, "v_proj") not in chat.weights and (0, "down_proj") not in chat.weights
    poet = load_adapter(folders / "poet", EVERY, 16)
    assert poet.weights[(0, "q_proj")][2] == pytest.approx(8 / math.sqrt(4))  # rsLoRA
    assert set(p for _, p in poet.weights) == {"q_proj", "v_proj", "down_proj"}
    sql = load_adapter(folders / "sql", EVERY, 8)
    assert len(sql.weights) == 7 * LAYERS and sql.weights[(0, "k_proj")][2] == 2


@pytest.mark.parametrize("config, message", [
    (dict(bias="all"), "bias 'all'"), (dict(use_dora=True), "DoRA"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(peft_type="IA3"), "peft_type 'IA3'"), (dict(r=0), "positive 'r'")])
def test_unsupported_configs_are_refused_by_name(folders, tmp_path, config, message):
    with pytest.raises(LoRAError, match=message):
        load_adapter(edited(folders, tmp_path, "sql", **config), EVERY, 16)


def test_ranks_modules_and_tensors_the_base_cannot_take(folders, tmp_path):
    with pytest.raises(LoRAError, match="LoRA rank 16 .* greater than max_lora_rank 8"):
        load_adapter(folders / "chat", EVERY, 8)
    no_gate = [set(ALL) - {"gate_proj", "up_proj", "down_proj"}] * LAYERS  # as an MoE layer
    with pytest.raises(LoRAError, match="adapts gate_proj of layer 0, which the base"):
        load_adapter(folders / "chat", no_gate, 16)
    with pytest.raises(LoRAError, match="no adapter_config.json"):
        load_adapter(folders / "base", EVERY, 16)
    out = edited(folders, tmp_path, "sql")
    tensors = load_file(out / "adapter_model.safetensors")
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = np.zeros((8, 211),
                                                                               np.float32)
    save_file(tensors, out / "adapter_model.safetensors")
    with pytest.raises(LoRAError, match="embed_tokens.lora_embedding_A"):
        load_adapter(out, EVERY, 16)
    del tensors["base_model.model.model.embed_tokens.lora_embedding_A"]
    del tensors["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"]
    save_file(tensors, out / "adapter_model.safetensors")
    with pytest.raises(LoRAError, match="layer 1 up_proj has lora_A without its other half"):
        load_adapter(out, EVERY, 16)


def test_digest_follows_the_weights_not_the_name(folders, tmp_path):
    a = load_adapter(folders / "sql", EVERY, 16)
    assert load_adapter(edited(folders, tmp_path, "sql"), EVERY, 16).digest == a.digest
    assert load_adapter(folders / "poet", EVERY, 16).digest != a.digest
    changed = tmp_path / "changed"
    changed.mkdir()
    (changed / "adapter_config.json").write_bytes(
        (folders / "sql" / "adapter_config.json").read_bytes())
    tensors = load_file(folders / "sql" / "adapter_model.safetensors")
    next(iter(tensors.values()))[0, 0] += 1
    save_file(tensors, changed / "adapter_model.safetensors")
    assert load_adapter(changed, EVERY, 16).digest != a.digest


def adapter(digest):
    return SimpleNamespace(digest=digest, name=digest)


def test_slots_stay_while_used_and_the_least_recent_one_goes():
    writes = []
    m = LoRAManager(LoRAConfig(max_loras=2), EVERY, lambda s, a: writes.append((s, a.digest)))
    a, b, c = adapter("a"), adapter("b"), adapter("c")
    assert m.step_slots([a, None, b, a]) == [0, -1, 1, 0]
    assert m.step_slots([b, a]) == [1, 0] and len(writes) == 2  # resident: no write
    assert m.step_slots([c, b]) == [0, 1]  # a was used least recently
    assert m.step_slots([a, c]) == [1, 0]  # b goes, c stays where it is
    assert writes == [(0, "a"), (1, "b"), (0, "c"), (1, "a")]
    with pytest.raises(RuntimeError, match="3 adapters in one step"):
        m.step_slots([a, b, c])


def test_parsed_adapters_lru_and_names(folders):
    m = LoRAManager(LoRAConfig(max_loras=1, max_cpu_loras=2), EVERY, lambda s, a: None)
    reqs = [LoRARequest(n, i + 1, str(folders / n)) for i, n in enumerate(("sql", "poet", "chat"))]
    first = m.resolve(reqs[0])
    assert m.resolve(reqs[0]) is first
    m.resolve(reqs[1])
    m.resolve(reqs[2])  # sql, least recently used, is dropped
    again = m.resolve(reqs[0])
    assert again is not first and again.digest == first.digest
    named = m.register("poet", str(folders / "poet"))
    assert m.named == {"poet": named} and named.lora_int_id >= 1
    with pytest.raises(LoRAError, match="already been loaded"):
        m.register("poet", str(folders / "chat"))
    assert m.unregister("poet") == m.resolve(reqs[1]).digest
    with pytest.raises(KeyError):
        m.unregister("poet")


def test_scheduler_runs_at_most_max_loras_adapters():
    sched = make_scheduler(max_loras=2, max_num_seqs=8)
    loras = [adapter("a"), adapter("b"), None, adapter("a"), adapter("c"), adapter("b")]
    for i, lora in enumerate(loras):
        req = make_request(i, 6, max_tokens=3)
        req.lora = lora
        sched.add_request(req)
    running = []
    while sched.has_unfinished:
        out, _ = step(sched)
        keys = {s.request.lora_key for s in out.scheduled} - {None}
        assert len(keys) <= 2
        running.append([s.request.request_id for s in out.scheduled])
    assert running[0] == ["0", "1", "2", "3"]  # "4" (a third adapter) waits, FCFS
    assert any("4" in ids for ids in running)


def test_page_hashes_are_keyed_by_adapter():
    sched = make_scheduler()
    kvm = sched.kv_cache_manager
    plain, with_a, with_b = (Request(str(i), [5] * 8, SamplingParams()) for i in range(3))
    with_a.lora, with_b.lora = adapter("a"), adapter("b")
    keys = [kvm.extra_keys(r) for r in (plain, with_a, with_b)]
    assert len(set(keys)) == 3 and keys[1][-1] == "lora:a"


def test_config_and_module_flags():
    assert LoRAConfig().cpu_capacity == 1 and LoRAConfig(max_loras=3).cpu_capacity == 3
    for bad in (dict(max_loras=0), dict(max_lora_rank=12), dict(max_loras=4, max_cpu_loras=2)):
        with pytest.raises(LoRAError):
            LoRAConfig(**bad)
    assert LoRAModule.parse("sql=/a/b") == LoRAModule("sql", "/a/b")
    assert LoRAModule.parse('{"name": "x", "path": "/p", "base_model_name": "m"}') == \
        LoRAModule("x", "/p", "m")
    for bad in ("sql", "=/p", '{"name": "x"}', '{"name": "x", "path": "/p", "extra": 1}'):
        with pytest.raises(LoRAError):
            LoRAModule.parse(bad)


def test_serve_refuses_adapter_flags_it_cannot_honour(folders, capsys):
    from serving.cli import main
    base = str(folders / "base")
    cases = [(["--lora-modules", f"sql={folders / 'sql'}"], "--lora-modules needs --enable-lora"),
             (["--enable-lora", "--served-model-name", "m", "--lora-modules", "m=/x"],
              "'m' is the served model's name"),
             (["--enable-lora", "--lora-modules", "sql"], "expected name=path or JSON"),
             (["--enable-lora", "--max-lora-rank", "12"], "max_lora_rank must be one of")]
    for flags, message in cases:
        assert main(["serve", base, "--port", "0", *flags]) == 1
        assert message in capsys.readouterr().err, flags
