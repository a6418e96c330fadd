"""A tensor-parallel step for GPUs, lowered on this CPU host (docs/architecture.md, "Tensor
parallelism"): a Llama-3.1-8B-shaped decode step at TP=8 on an abstract mesh of 8 H200s,
abstract weights, lowered for CUDA with the Pallas kernel per shard. Its HLO holds the
collectives the design promises and no others: two all-reduces per layer (o_proj, down_proj)
and one for the vocabulary-parallel embedding, each of the step's hidden states in bfloat16,
and one all-gather of the logits."""
from __future__ import annotations

import pytest

from serving.engine.tp_lowering import describe, llama_8b, step_report

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report():
    return step_report(llama_8b(), 8, (64, 64, 64))


def test_two_all_reduces_per_layer_and_one_gather_of_the_logits(report):
    cfg = llama_8b()
    assert report.count("all_reduce") == 2 * cfg.num_layers + 1
    assert {(c.shape, c.dtype) for c in report.collectives if c.op == "all_reduce"} == {
        ((64, 4096), "bf16")}
    gathers = [c for c in report.collectives if c.op == "all_gather"]
    assert [(c.shape, c.dtype) for c in gathers] == [((64, 128256 // 8), "bf16")]
    assert len(report.collectives) == 2 * cfg.num_layers + 2  # nothing else moves
    assert report.bytes_of("all_reduce") == (2 * 32 + 1) * 64 * 4096 * 2


def test_each_gpu_holds_an_eighth(report):
    # 8.03e9 parameters in bfloat16, split 8 ways; norms are whole on each GPU.
    assert 1.85 < report.weight_bytes / 2**30 < 1.9
    # 1 of 8 KV heads of 128 values, K and V, 32 layers, bfloat16: 16 KiB per token.
    assert report.kv_bytes_per_token == 2 * 32 * 128 * 2
    assert "all-reduces: 65 = 2 per layer x 32 layers + 1" in describe(report)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_qwen3_30b_a3b_moves_what_a_dense_model_does(expert_parallel):
    """Qwen3-30B-A3B at TP=8, its 128 experts split 8 ways each or 16 whole ones per GPU
    (the layout that works on every backend: tokens on every device, local experts, one
    psum): the same two all-reduces per layer as a dense model and nothing more; each GPU
    holds an eighth of every expert's weights either way."""
    from serving.engine.mesh import with_expert_parallel
    from serving.engine.tp_lowering import qwen3_30b_a3b
    cfg = with_expert_parallel(qwen3_30b_a3b(), 8, expert_parallel)
    r = step_report(cfg, 8, (16, 16, 16))
    assert r.count("all_reduce") == 2 * cfg.num_layers + 1
    assert {(c.shape, c.dtype) for c in r.collectives if c.op == "all_reduce"} == {
        ((16, 2048), "bf16")}
    assert len(r.collectives) == 2 * cfg.num_layers + 2
    # 30.5e9 parameters in bfloat16 over 8 GPUs; norms and routers whole on each
    assert 7.1 < r.weight_bytes / 2**30 < 7.2
    text = describe(r)
    assert ("16 of 128 experts per device" in text) == expert_parallel
