"""Data-parallel attention with expert parallelism (`-dp 2 --enable-expert-parallel`) on two
simulated CPU devices, in child processes (docs/architecture.md, "Fleets: routers, data
parallelism and disaggregation"): two ranks stepping in one program, each with its own
requests and KV cache, the experts split between the devices, give one engine's tokens and
logprobs, whether the requests are spread over the ranks or all on one (the other stepping
on padding); and `xlaserve serve` with those flags answers on either rank as one engine."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.hf_tiny import tiny_hf_model
from tests.server_util import free_port, get_json, post, wait_healthy
from tests.tp_child import MAX_TOKENS, PROMPTS

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
RANKS = 2


@pytest.fixture(scope="module")
def models(tmp_path_factory, demo_model_dir) -> dict[str, Path]:
    """4 experts (2 a device); Qwen2-MoE with its shared expert and a dense layer. The
    Qwen3-MoE one has the demo's tokenizer (and its vocabulary size), so the server detokenizes
    as for any model."""
    root = tmp_path_factory.mktemp("dpa-models")
    made = {}
    demo_vocab = {"vocab_size": 49152}
    for family, extra in (("qwen2_moe", {}), ("qwen3_moe", demo_vocab), ("llama", demo_vocab)):
        made[family] = root / family
        tiny_hf_model(family, made[family], seed=1, **extra)
    for family in ("qwen3_moe", "llama"):
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(demo_model_dir / name, made[family] / name)
    return made


def child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return dict(env, PYTHONPATH=str(ROOT))


@pytest.fixture(scope="module")
def results(models, tmp_path_factory):
    cpu = dict(attention_backend="cpu")
    spec = {"qwen2-moe": dict(model=str(models["qwen2_moe"]),
                              options=dict(cpu, quantize="none")),
            "qwen3-moe-int8": dict(model=str(models["qwen3_moe"]),
                                   options=dict(cpu, quantize="int8")),
            "llama": dict(model=str(models["llama"]), options=dict(cpu, quantize="none"),
                          reference_only=True)}
    path = tmp_path_factory.mktemp("dpa-cases") / "cases.json"
    path.write_text(json.dumps(spec))
    done = subprocess.run([sys.executable, "-m", "tests.dp_attention_child", str(RANKS),
                           str(path)], capture_output=True, text=True, cwd=ROOT,
                          env=child_env(), timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["qwen2-moe", "qwen3-moe-int8"])
def test_ranks_in_one_program_give_one_engines_tokens(results, name):
    out = results[name]
    one = out["reference"]
    assert len({t for seq in one["tokens"] for t in seq}) >= 4, one["tokens"]  # a real check
    assert all(len(seq) == MAX_TOKENS for seq in one["tokens"])
    for run in ("spread", "last_rank"):
        assert out[run]["tokens"] == one["tokens"], run  # greedy and seeded alike
        np.testing.assert_allclose(out[run]["logprobs"][1], one["logprobs"][1], atol=2e-3)
    assert (out["devices"], out["experts_per_device"]) == (RANKS, 4 // RANKS)


SERVE_FLAGS = ["--attention-backend", "cpu", "--max-num-seqs", "4", "--max-model-len", "64",
               "--max-num-batched-tokens", "16", "--page-size", "4", "--token-buckets", "16",
               "--request-buckets", "4", "--disable-log-stats", "--data-parallel-size",
               str(RANKS)]


def start(model: Path, flags: list[str], tmp: Path, processes: int) -> tuple[int, list]:
    """`xlaserve serve` of RANKS ranks: one process with RANKS simulated devices, or RANKS
    processes of one device each (jax.distributed over loopback); -> (port, processes)."""
    port, coordinator = free_port(), f"127.0.0.1:{free_port()}"
    env = dict(child_env(), XLA_FLAGS=f"--xla_force_host_platform_device_count="
                                      f"{RANKS // processes}", JAX_PLATFORMS="cpu")
    procs = []
    for i in range(processes):
        cluster = (["--coordinator-address", coordinator, "--num-processes", str(processes),
                    "--process-id", str(i), "--compilation-cache-dir", ""]
                   if processes > 1 else [])
        with (tmp / f"server{i}.log").open("w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "serving", "serve", str(model), "--port", str(port),
                 *SERVE_FLAGS, *flags, *cluster], cwd=ROOT, env=env, stdout=out,
                stderr=subprocess.STDOUT))
    wait_healthy(port, 300, alive=lambda: all(p.poll() is None for p in procs)
                 or print((tmp / "server0.log").read_text()[-3000:]))
    return port, procs


def answers_as(port: int, tokens: list[int]) -> None:
    """Greedy on rank 0, on rank 1 and placed by the server: the reference's text."""
    status, expected = post(port, "/detokenize", {"tokens": tokens})
    assert status == 200, expected
    body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}
    for headers in ({"X-data-parallel-rank": "0"}, {"X-data-parallel-rank": "1"}, None):
        status, answer = post(port, "/v1/completions", body, headers)
        assert status == 200, answer
        assert answer["choices"][0]["text"] == expected["prompt"], headers
        assert answer["usage"]["completion_tokens"] == MAX_TOKENS


def stop(procs: list) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("family, case, flags", [
    ("qwen3_moe", "qwen3-moe-int8", ["--enable-expert-parallel", "--quantize", "int8"]),
    ("llama", "llama", ["--quantize", "none"])])
def test_two_processes_one_rank_each(models, results, tmp_path, family, case, flags):
    """-dp over jax.distributed: a mixture's ranks split its experts across the processes;
    a dense model's ranks step together all the same (one program over every device)."""
    port, procs = start(models[family], flags, tmp_path, processes=RANKS)
    try:
        answers_as(port, results[case]["reference"]["tokens"][0])
        status, load = get_json(port, "/get_load")
        assert [entry["dp_rank"] for entry in load] == [0, 1]
    finally:
        stop(procs)


def test_serve_answers_on_either_rank_as_one_engine(models, results, tmp_path):
    port, procs = start(models["qwen3_moe"], ["--enable-expert-parallel", "--quantize", "int8"],
                        tmp_path, processes=1)
    try:
        answers_as(port, results["qwen3-moe-int8"]["reference"]["tokens"][0])
        body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS}
        status, refused = post(port, "/v1/completions", {**body, "prompt_logprobs": 1})
        assert status == 400 and "data-parallel attention" in refused["error"]["message"]
        status, load = get_json(port, "/get_load")
        assert [entry["dp_rank"] for entry in load] == [0, 1]
        status, info = get_json(port, "/server_info")
        assert info["dp_size"] == RANKS
    finally:
        stop(procs)


def test_what_data_parallel_attention_refuses(models):
    """Before the weights load: a dense model, experts that do not split, too few devices,
    latent attention, and the options it does not run yet."""
    from model.config import ModelConfig
    from serving.core.config import EngineConfig
    from serving.engine.dp_attention import check, check_model
    cfg = ModelConfig.from_dir(models["qwen3_moe"])
    check_model(cfg, 2, 2)
    with pytest.raises(ValueError, match="4 experts do not split 3 ways"):
        check_model(cfg, 3, 4)
    with pytest.raises(ValueError, match="needs 4 devices; there are 2"):
        check_model(cfg, 4, 2)
    with pytest.raises(ValueError, match="for mixture-of-experts models"):
        check_model(dataclasses.replace(cfg, num_experts=0), 2, 2)
    with pytest.raises(ValueError, match=r"does not run latent attention \(Qwen3MoeForCausal"
                                         r"LM\) yet; use --tensor-parallel-size 2"):
        check_model(dataclasses.replace(cfg, kv_lora_rank=16), 2, 2)
    options = EngineConfig(data_parallel_size=2, enable_expert_parallel=True,
                           tensor_parallel_size=2, enable_lora=True)
    with pytest.raises(ValueError, match="--tensor-parallel-size > 1, --enable-lora"):
        check(options, models["qwen3_moe"], "generate", None)
