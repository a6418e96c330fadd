"""The periodic stats line: throughput over the interval, the prefix cache hit rate, and no
line while nothing happens. No JAX."""
from serving.engine.async_engine import EngineStats
from serving.engine.stats_log import StatsLogger


def stats(running=0, waiting=0, usage=0.0, queries=0, hits=0, prompt=0, generated=0):
    return EngineStats(running, waiting, usage, 0, queries, hits, prompt, generated)


def test_stats_line_reports_the_interval():
    now = [0.0]
    logger = StatsLogger(10.0, clock=lambda: now[0])
    now[0] = 5.0
    assert logger.maybe_log(stats(running=2)) is None  # not due yet
    now[0] = 10.0
    line = logger.maybe_log(stats(2, 1, 0.25, queries=1000, hits=750, prompt=400, generated=50))
    assert line == ("Running: 2 reqs, Waiting: 1 reqs, Avg prompt throughput: 40.0 tokens/s, "
                    "Avg generation throughput: 5.0 tokens/s, KV cache usage: 25.0%, "
                    "Prefix cache hit rate: 75.0%")
    now[0] = 30.0  # 20 s later: 100 more queries, 10 hits, 200 more generated tokens
    line = logger.maybe_log(stats(1, 0, 0.5, queries=1100, hits=760, prompt=490, generated=250))
    assert "Avg prompt throughput: 4.5 tokens/s" in line
    assert "Avg generation throughput: 10.0 tokens/s" in line
    assert line.endswith("Prefix cache hit rate: 10.0%")


def test_no_line_while_idle_and_the_total_rate_when_nothing_was_looked_up():
    now = [0.0]
    logger = StatsLogger(1.0, clock=lambda: now[0])
    now[0] = 1.0
    assert logger.maybe_log(stats(queries=10, hits=5, prompt=10, generated=3))
    now[0] = 2.0
    assert logger.maybe_log(stats(queries=10, hits=5, prompt=10, generated=3)) is None
    now[0] = 3.0
    line = logger.maybe_log(stats(running=1, queries=10, hits=5, prompt=10, generated=4))
    assert line.endswith("Prefix cache hit rate: 50.0%")
    assert "Avg generation throughput: 1.0 tokens/s" in line  # over the 1 s since the last check


def test_stats_line_shows_the_draft_acceptance_rate_over_the_interval():
    from serving.core.spec_decode import SpecDecodeStats
    spec = SpecDecodeStats()
    now = [0.0]
    logger = StatsLogger(1.0, clock=lambda: now[0])
    off = logger.maybe_log
    now[0] = 1.0
    assert "Spec decode" not in off(stats(running=1, generated=1))
    first = EngineStats(1, 0, 0.0, 0, num_generation_tokens_total=5, spec=spec.snapshot())
    now[0] = 2.0
    assert first.spec is not None and off(first).endswith("draft acceptance rate: n/a")
    spec.observe(3, 3)  # 3 proposed, all accepted
    spec.observe(3, 1)  # 3 proposed, the first accepted
    now[0] = 3.0
    line = off(EngineStats(1, 0, 0.0, 0, num_generation_tokens_total=12,
                           spec=spec.snapshot()))
    assert line.endswith("Spec decode draft acceptance rate: 66.7%, mean acceptance length: "
                         "3.00, per-position acceptance rate: 1.00 0.50 0.50")
    spec.observe(2, 0)
    now[0] = 4.0
    line = off(EngineStats(1, 0, 0.0, 0, num_generation_tokens_total=13,
                           spec=spec.snapshot()))
    assert line.endswith("draft acceptance rate: 0.0%, mean acceptance length: 1.00, "
                         "per-position acceptance rate: 0.00 0.00 0.00")


def test_spec_decode_metrics_have_vllms_names():
    from serving.core.spec_decode import SpecDecodeStats
    from serving.openai.metrics import Metrics
    m, spec = Metrics("m"), SpecDecodeStats()
    spec.observe(4, 2)
    spec.observe(4, 3)
    m.set_spec_decode_stats(spec)
    m.set_spec_decode_stats(spec)  # running totals: counted once
    text = m.render().decode()
    for name, value in (("num_drafts", 2), ("num_draft_tokens", 8),
                        ("num_accepted_tokens", 5)):
        assert f'xlaserve:spec_decode_{name}_total{{model_name="m"}} {value:.1f}' in text
    assert ('xlaserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",'
            'position="2"} 1.0') in text
