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
