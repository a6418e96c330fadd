"""What `quantize="auto"` and `kv_cache_dtype="auto"` mean, resolved once at start-up.

For a model the user names, "auto" keeps the checkpoint's weights (quantized or not) and
stores the KV cache in the model's dtype, as vLLM does; a GGUF file's cache is float16, as
llama.cpp keeps it for the same file. For the demo model (no model named)
on a CPU it is the fastest configuration docs/benchmarks.md measured: int4 weights with an
int8 head and a float16 KV cache. The demo's weights come from a 4-bit GGUF (the file
llama.cpp serves, Q4_1 layers and a Q8_0 embedding); int4 gives back the layers' own codes, and
its int4 kernel keeps activations at 16 bits, so the default answers as the weights do as
converted (docs/benchmarks.md, "CPU defaults that answer as converted"). `quantize="none"`
with `kv_cache_dtype="float32"` serves the demo exactly as converted.
"""
from __future__ import annotations

import dataclasses
import logging

from model.formats.gguf_file import is_gguf_path
from serving.core.config import EngineConfig

log = logging.getLogger("xlaserve")

CPU_DEMO_QUANTIZE = "int4:lm_head"
CPU_DEMO_KV_CACHE_DTYPE = "float16"
GGUF_KV_CACHE_DTYPE = "float16"  # llama.cpp's cache type for K and V (-ctk / -ctv f16)


def resolve(ec: EngineConfig, on_gpu: bool) -> EngineConfig:
    """ec with `quantize` a recipe spec or None and `kv_cache_dtype` never "auto" for the
    demo on a CPU; logs what the demo defaults chose."""
    demo_cpu = ec.model is None and not on_gpu
    quantize = ec.quantize
    if quantize == "auto":
        quantize = CPU_DEMO_QUANTIZE if demo_cpu else None
    elif quantize == "none":
        quantize = None
    kv = ec.kv_cache_dtype
    if kv == "auto" and demo_cpu:
        kv = CPU_DEMO_KV_CACHE_DTYPE
    elif kv == "auto" and ec.model is not None and is_gguf_path(ec.model):
        kv = GGUF_KV_CACHE_DTYPE
        log.info("a GGUF file: a %s KV cache, llama.cpp's default (--kv-cache-dtype sets "
                 "another)", kv)
    if demo_cpu and (quantize, kv) == (CPU_DEMO_QUANTIZE, CPU_DEMO_KV_CACHE_DTYPE):
        log.info("demo model on a CPU: %s weights and a %s KV cache, the fastest measured "
                 "configuration (--quantize none --kv-cache-dtype float32 serve it as "
                 "converted)", quantize, kv)
    return dataclasses.replace(ec, quantize=quantize, kv_cache_dtype=kv)
