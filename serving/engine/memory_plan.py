"""How device memory is split between weights, a step's activations and the KV cache (GPU).

vLLM's meaning of `--gpu-memory-utilization` (default 0.9): the fraction of the device's TOTAL
memory this engine may use for everything: weights, the temporaries of the largest step and the
KV cache. The KV cache gets what the other two leave:

    kv_cache = utilization * device - weights - activation_peak

`--kv-cache-memory BYTES` sets the KV cache's size directly instead (vLLM's
`--kv-cache-memory-bytes`); the total must still fit the device.

XLA's allocator is told the same budget before the backend starts (`configure_xla_allocator`):
by default it preallocates 75% of the device and refuses anything past it, which would cap the
engine below the plan. Plain Python, no JAX: the plan is a pure function, tested on a CPU.

`weight_bytes` counts a model's weights from their shapes in a storage form (`WeightForm`),
so a plan can be made for a checkpoint whose form this host cannot load or hold (DeepSeek-V3's
fp8 weights with 128 x 128 block scales on eight GPUs: tests/test_memory_plan.py).
"""
from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass

from quant.recipe import FLOAT_KERNELS

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
XLA_DEFAULT_MEM_FRACTION = 0.75  # XLA_PYTHON_CLIENT_MEM_FRACTION when unset
GIB = 1 << 30


class MemoryPlanError(ValueError):
    pass


@dataclass(frozen=True)
class MemoryPlan:
    device_bytes: int  # the device's total memory
    budget_bytes: int  # gpu_memory_utilization x device_bytes
    weight_bytes: int
    activation_bytes: int  # temporaries of the largest step program
    page_bytes: int  # one KV page, every layer, K and V
    page_size: int
    num_pages: int  # pages allocated, the sink page 0 included
    max_model_len: int
    seq_pages: int = 0  # window model: the most pages a request holds; 0: no bound
    # A hybrid model (serving/engine/kv_pools.py): the window layers' pool, sink included;
    # page_bytes and num_pages are then the full-attention layers'
    window_pages: int = 0
    window_page_bytes: int = 0
    kv_layout: str = ""  # tensor parallel: what of the cache each device holds (sizing.kv_layout)

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_pages * self.page_bytes + self.window_pages * self.window_page_bytes

    @property
    def kv_tokens(self) -> int:
        return (self.num_pages - 1) * self.page_size

    @property
    def max_concurrency(self) -> float:
        """Sequences of max_model_len tokens the cache holds at once."""
        return (self.num_pages - 1) / sequence_pages(self.max_model_len, self.page_size,
                                                     self.seq_pages)

    def describe(self) -> str:
        return (f"memory plan: device {self.device_bytes / GIB:.1f} GiB, budget "
                f"{self.budget_bytes / GIB:.1f} GiB = weights {self.weight_bytes / GIB:.2f} GiB "
                f"+ activation peak {self.activation_bytes / GIB:.2f} GiB + KV cache "
                f"{self.kv_cache_bytes / GIB:.2f} GiB ({self.num_pages - 1} pages of "
                f"{self.page_size} tokens = {self.kv_tokens} tokens; "
                f"{self.max_concurrency:.2f} sequences of max_model_len {self.max_model_len} "
                f"at once)" + (f"; of it the window layers' pool {self.window_pages - 1} pages"
                               if self.window_pages else "")
                + (f"; {self.kv_layout}" if self.kv_layout else ""))


@dataclass(frozen=True)
class WeightForm:
    """How a checkpoint stores its linear kernels: bytes per parameter, and one float scale
    per block of (input rows, output columns); (0, 0): no scales. Every other weight (the
    embedding, head, norms, routers, latent attention's k_up / v_up) keeps its own dtype."""
    name: str
    linear_bytes: float
    block: tuple[int, int] = (0, 0)
    scale_bytes: int = 4


# DeepSeek-V3's, R1's and Kimi K2's checkpoints (quantization_config weight_block_size).
FP8_BLOCK_128 = WeightForm("fp8 e4m3 with a float32 scale per 128 x 128 block", 1, (128, 128))


def quantized_linear(path: tuple[str, ...]) -> bool:
    """A kernel a quantized form covers: quant/recipe.py's rule (a layer's kernels, but not
    a router's nor a shared expert's gate)."""
    return path[0] == "layers" and path[-1] == "kernel" and path[-2] not in FLOAT_KERNELS


def weight_bytes(leaves, form: WeightForm) -> int:
    """leaves: (path names, shape, itemsize) of every weight (one device's, under tensor
    parallel) -> their bytes in `form`. A kernel's last two axes are [in, out]; leading
    ones (layers, experts) each have blocks of their own."""
    total = 0
    for path, shape, itemsize in leaves:
        size = math.prod(shape)
        if not quantized_linear(path):
            total += size * itemsize
            continue
        total += math.ceil(size * form.linear_bytes)
        if form.block != (0, 0):
            rows, cols = form.block
            blocks = -(-shape[-2] // rows) * -(-shape[-1] // cols)
            total += math.prod(shape[:-2]) * blocks * form.scale_bytes
    return total


def sequence_pages(max_len: int, page_size: int, seq_pages: int = 0) -> int:
    """Pages one sequence of max_len tokens holds at once: all of them, or on a window model
    at most seq_pages (the pages behind the window go back as it grows)."""
    pages = -(-max_len // page_size)
    return min(pages, seq_pages) if seq_pages else pages


def plan_memory(*, device_bytes: int, weight_bytes: int, activation_bytes: int,
                page_bytes: int, page_size: int, model_max_len: int,
                max_model_len: int | None = None,
                gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
                kv_cache_memory: int | None = None, seq_pages: int = 0,
                window=None, kv_layout: str = "") -> MemoryPlan:
    """The split of one device's memory; raises MemoryPlanError (before anything large is
    allocated) when the model, or one sequence of the requested length, does not fit.

    max_model_len None: the model's whole context (model_max_len) if the cache holds one
    sequence of it, else the longest whole number of pages it does hold. seq_pages: on a
    window model, the most pages a request holds however long it grows; 0: no bound.
    window: a hybrid model's window-layer pool (serving/engine/kv_pools.WindowPool), taken
    out of the KV cache's share first; page_bytes is then the full-attention layers'.
    kv_layout: said in the description (sizing.kv_layout)."""
    if not 0 < gpu_memory_utilization <= 1:
        raise MemoryPlanError(f"gpu_memory_utilization must be in (0, 1], got "
                              f"{gpu_memory_utilization}")
    budget = int(gpu_memory_utilization * device_bytes)
    fixed = weight_bytes + activation_bytes
    if kv_cache_memory is not None:
        kv = int(kv_cache_memory)
        if fixed + kv > device_bytes:
            raise MemoryPlanError(
                f"weights {weight_bytes / GIB:.2f} GiB + activation peak "
                f"{activation_bytes / GIB:.2f} GiB + kv_cache_memory {kv / GIB:.2f} GiB exceed "
                f"the device's {device_bytes / GIB:.1f} GiB")
        budget = fixed + kv
    else:
        kv = budget - fixed
    window_pages = window.pages_within(kv) if window is not None and kv > 0 else 0
    kv -= window.bytes(window_pages) if window_pages else 0
    if kv < 2 * page_bytes:  # the sink and one usable page
        raise MemoryPlanError(
            f"the model does not fit: weights {weight_bytes / GIB:.2f} GiB + activation peak "
            f"{activation_bytes / GIB:.2f} GiB leave no room for a KV cache in "
            f"gpu_memory_utilization {gpu_memory_utilization} x {device_bytes / GIB:.1f} GiB = "
            f"{budget / GIB:.1f} GiB; quantize the weights (--quantization int8 / fp8), lower "
            "--max-num-batched-tokens, or raise --gpu-memory-utilization")
    num_pages = kv // page_bytes  # the sink included
    usable_tokens = (num_pages - 1) * page_size
    fits = lambda n: sequence_pages(n, page_size, seq_pages) <= num_pages - 1
    if max_model_len is None:
        max_len = model_max_len if fits(model_max_len) else usable_tokens
    else:
        if not fits(max_model_len):
            raise MemoryPlanError(
                f"max_model_len {max_model_len} needs "
                f"{sequence_pages(max_model_len, page_size, seq_pages)} KV pages, "
                f"but the cache holds {num_pages - 1} ({kv / GIB:.2f} GiB, {usable_tokens} "
                "tokens); lower --max-model-len or raise --gpu-memory-utilization")
        max_len = max_model_len
    return MemoryPlan(device_bytes=device_bytes, budget_bytes=budget, weight_bytes=weight_bytes,
                      activation_bytes=activation_bytes, page_bytes=page_bytes,
                      page_size=page_size, num_pages=int(num_pages), max_model_len=int(max_len),
                      seq_pages=seq_pages, window_pages=window_pages,
                      window_page_bytes=window.page_bytes if window_pages else 0,
                      kv_layout=kv_layout)


def configure_xla_allocator(gpu_memory_utilization: float, environ=os.environ) -> float:
    """Points XLA's GPU allocator at the plan's budget; call before JAX starts its backend
    (it reads these once). A fraction the user set is kept. Returns the fraction in effect."""
    environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{gpu_memory_utilization:.4f}")
    return allocator_fraction(environ)


def configure_xla_allocator_if_unstarted(gpu_memory_utilization: float) -> None:
    """configure_xla_allocator, unless JAX's backends already started (then the fraction in
    the environment is the one they read, and the plan divides by it)."""
    if "jax" in sys.modules:
        from jax._src import xla_bridge
        if xla_bridge.backends_are_initialized():
            return
    configure_xla_allocator(gpu_memory_utilization)


def allocator_fraction(environ=os.environ) -> float:
    return float(environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", XLA_DEFAULT_MEM_FRACTION))


def device_total_bytes(allocator_limit: int, environ=os.environ) -> int:
    """A GPU's total memory from its allocator's limit (JAX reports only the limit, which XLA
    sets to XLA_PYTHON_CLIENT_MEM_FRACTION of the total)."""
    return int(allocator_limit / allocator_fraction(environ))


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_bytes(text: str | int | float) -> int:
    """A size in bytes: 20GiB (powers of 1024), 20GB or 20G (powers of 1000), 2000000000."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _SIZE.match(text)
        if not m:
            raise ValueError(f"expected a size in bytes such as 20GiB or 2000000000, got {text!r}")
        base = 1024 if m.group(3) else 1000
        value = float(m.group(1)) * base ** _POWERS[m.group(2).lower()]
    if value < 1024:
        raise ValueError(f"kv_cache_memory is a size in bytes (such as 20GiB), got {text!r}; "
                         "a fraction of device memory is --gpu-memory-utilization")
    return int(value)
