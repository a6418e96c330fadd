"""Serving: the host-side scheduler and the device-side engine, the offline API and the server.

`LLM` and the engine pull in JAX; they are imported on first use so that the host-side
modules (scheduler, pages, buckets, protocol) stay importable without it.
"""
from serving.core.sampling_params import SamplingParams
from serving.lora.request import LoRARequest

__all__ = ["LLM", "LoRARequest", "SamplingParams"]


def __getattr__(name):
    if name == "LLM":
        from serving.engine.llm import LLM
        return LLM
    raise AttributeError(name)
