"""Our metrics again under vLLM's names, for the fleet tools that only know those.

llm-d's scorers, KServe's autoscaling and vLLM's Grafana dashboards query
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, `vllm:lora_requests_info`,
`vllm:cache_config_info`, ...; the production-stack router reads vLLM's older names
(`vllm:gpu_cache_usage_perc`, `vllm:gpu_prefix_cache_hit_rate`, ...), and none of them can be
told another prefix. Our series already carry vLLM's names under `xlaserve:`, so the alias
is the same samples renamed at scrape time (nothing is counted twice), plus the older names
derived from the current ones.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Metric
from prometheus_client.registry import Collector

OURS, VLLM = "xlaserve:", "vllm:"


class VllmNames(Collector):
    """Collects `source` (a registry of `xlaserve:` series) as `vllm:` series."""

    def __init__(self, source: CollectorRegistry):
        self.source = source

    def collect(self):
        families = list(self.source.collect())
        for family in families:
            if family.name.startswith(OURS):
                yield _renamed(family, VLLM + family.name[len(OURS):])
        yield from _older_names(families)


def vllm_aliases(source: CollectorRegistry) -> CollectorRegistry:
    """A registry whose scrape is `source`'s series under vLLM's names."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(VllmNames(source))
    return registry


def _renamed(family: Metric, name: str) -> Metric:
    out = Metric(name, family.documentation, family.type, family.unit)
    old = family.name
    for s in family.samples:
        out.add_sample(name + s.name[len(old):], s.labels, s.value, s.timestamp, s.exemplar)
    return out


def _older_names(families: list[Metric]):
    """vLLM's v0 names, still read by the production-stack router: the KV usage gauge and
    the prefix cache's running totals with their ratio."""
    by_name = {f.name: f for f in families}
    usage = by_name.get(OURS + "kv_cache_usage_perc")
    if usage is not None:
        yield _renamed(usage, VLLM + "gpu_cache_usage_perc")
    totals = {}
    for ours, older in (("prefix_cache_queries", "gpu_prefix_cache_queries"),
                        ("prefix_cache_hits", "gpu_prefix_cache_hits")):
        family = by_name.get(OURS + ours)
        if family is None:
            continue
        yield _renamed(family, VLLM + older)
        totals[ours] = {_key(s.labels): (s.labels, s.value) for s in family.samples
                        if s.name.endswith("_total")}
    queries, hits = totals.get("prefix_cache_queries", {}), totals.get("prefix_cache_hits", {})
    rate = Metric(VLLM + "gpu_prefix_cache_hit_rate",
                  "Prefix cache hit rate: tokens found over tokens looked up (0 to 1).", "gauge")
    for key, (labels, looked_up) in queries.items():
        found = hits.get(key, (labels, 0.0))[1]
        rate.add_sample(rate.name, labels, found / looked_up if looked_up else 0.0)
    yield rate


def _key(labels: dict) -> tuple:
    return tuple(sorted(labels.items()))
