"""Times both ragged paged-attention kernels (per-key gathers: pallas; whole pages: pallas_pages)
over a sweep and prints achieved memory bandwidth (bytes that must move: K/V pages in use,
queries, output) next to the measured copy bandwidth.

    PYTHONPATH=. python scripts/bench_kernels.py                 # GPU: kernel (+ reference)
    PYTHONPATH=. python scripts/bench_kernels.py --quick         # CPU: tiny sweep, reference only
    PYTHONPATH=. python scripts/bench_kernels.py --tune          # + tiles for block_sizes.TUNED

Rows are printed (and appended to --out) as they finish; --max-seconds stops the sweep early.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from pallas_kernels.benchmark import (Shape, bench_shape, copy_bandwidth,  # noqa: E402
                                      tuning_variants)
from pallas_kernels.ragged_paged_attention_kernel import block_sizes_for  # noqa: E402


def gpu_sweep() -> list[Shape]:
    """Decode over (batch, context, GQA, page size, KV format), then prefill. The goal cases
    (batch >= 32, context >= 2k: >= 80% of copy bandwidth) come first, then the attention
    variants (bandwidth counts the keys inside the window)."""
    goal = [(32, 2048), (64, 2048), (128, 2048), (32, 8192), (64, 8192)]
    rest = [(b, c) for b in (1, 8, 32) for c in (512, 2048, 8192) if (b, c) not in goal]
    shapes = [Shape(f"decode-b{b}-c{c}", b, c) for b, c in goal]
    shapes += [  # Mistral's window at 4x its context; gpt-oss-20b's layers; Gemma 2's cap
        Shape("decode-b64-c8192-w2048", 64, 8192, window=2048),
        Shape("decode-b64-c2048-gptoss-w128-sinks", 64, 2048, heads=64, kv_heads=8,
              head_dim=64, window=128, sinks=True),
        Shape("decode-b64-c2048-gptoss-sinks", 64, 2048, heads=64, kv_heads=8, head_dim=64,
              sinks=True),
        Shape("decode-b64-c2048-gemma2-cap50", 64, 2048, heads=16, kv_heads=8, head_dim=256,
              soft_cap=50.0)]
    shapes += [Shape(f"decode-b{b}-c{c}", b, c) for b, c in rest]
    for page in (64, 256):
        shapes.append(Shape(f"decode-b32-c2048-p{page}", 32, 2048, page_size=page))
    shapes.append(Shape("decode-b32-c2048-g1", 32, 2048, heads=8, kv_heads=8))
    shapes.append(Shape("decode-b32-c2048-g8", 32, 2048, heads=64, kv_heads=8))
    shapes.append(Shape("decode-b32-c2048-d64-g3", 32, 2048, heads=9, kv_heads=3, head_dim=64))
    for kv in ("int8", "float8_e4m3fn"):
        shapes.append(Shape(f"decode-b64-c2048-{kv}", 64, 2048, kv_dtype=kv))
    shapes.append(Shape("prefill-1x512-c512", 1, 512, q_len=512))
    shapes.append(Shape("prefill-4x128-c2048", 4, 2048, q_len=128))
    return shapes


def cpu_sweep() -> list[Shape]:
    return [Shape("decode-b4-c256", 4, 256, heads=8, kv_heads=2, head_dim=64),
            Shape("decode-b16-c512", 16, 512, heads=8, kv_heads=2, head_dim=64),
            Shape("prefill-1x64-c128", 1, 128, q_len=64, heads=8, kv_heads=2, head_dim=64,
                  dtype="float32"),
            Shape("decode-b4-c256-w64-sinks-cap20", 4, 256, heads=8, kv_heads=2, head_dim=64,
                  window=64, sinks=True, soft_cap=20.0)]


def tune_sweep() -> list[Shape]:
    return [Shape("tune-b32-c2048", 32, 2048), Shape("tune-b1-c8192", 1, 8192)]


COLUMNS = ["case", "T", "batch", "ctx", "q_len", "G", "D", "page", "kv", "tiles",
           "pallas_ms", "pallas_GBps", "pallas_pct_copy", "page_tiles", "pallas_pages_ms",
           "pallas_pages_GBps", "pallas_pages_pct_copy", "reference_ms", "reference_GBps",
           "reference_pct_copy"]


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if v < 10 else f"{v:.1f}"
    return str(v)


class Table:
    def __init__(self, out: Path | None):
        self.out = out

    def line(self, text: str) -> None:
        print(text, flush=True)
        if self.out:
            with self.out.open("a") as f:
                f.write(text + "\n")

    def header(self) -> None:
        self.line(" | ".join(COLUMNS))

    def row(self, row: dict) -> None:
        self.line(" | ".join(fmt(row.get(c)) for c in COLUMNS))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sweep (CPU: reference only)")
    p.add_argument("--tune", action="store_true", help="also sweep tiles of a few decode cases")
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--cases", type=int, default=None,
                   help="only the first N cases of the sweep (the goal cases come first), "
                        "leaving time for --tune")
    p.add_argument("--max-seconds", type=float, default=float("inf"))
    p.add_argument("--out", type=Path, help="append the table to this file")
    args = p.parse_args()
    warnings.simplefilter("ignore", DeprecationWarning)  # the Pallas Triton backend's notice
    started = time.perf_counter()
    on_gpu = jax.default_backend() == "gpu"
    table = Table(args.out)
    dev = jax.devices()[0]
    bw = copy_bandwidth()
    table.line(f"# bench_kernels on {dev.device_kind} ({jax.default_backend()}), jax "
               f"{jax.__version__}; copy bandwidth {bw / 1e9:.1f} GB/s (read + write)")
    # Both kernels on every case: the faster becomes attention "auto"'s choice.
    backends = ["pallas", "pallas_pages"] if on_gpu else []
    if not args.no_reference:
        backends.append("reference")
    if not on_gpu:
        table.line("# no GPU: the kernel would only run in the interpreter; timing the "
                   "reference alone")
    table.header()
    shapes = cpu_sweep() if (args.quick or not on_gpu) else gpu_sweep()
    shapes = shapes[:args.cases] if args.cases else shapes
    failures = 0
    for shape in shapes:
        if time.perf_counter() - started > args.max_seconds:
            table.line(f"# stopped: --max-seconds {args.max_seconds:.0f} reached")
            break
        try:
            table.row(bench_shape(shape, backends, bw))
        except Exception as e:  # one failing case must not hide the others
            failures += 1
            table.line(f"# {shape.name}: FAILED {type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc()
    if args.tune and on_gpu:
        failures += tune(table, bw, started, args.max_seconds)
    return 1 if failures else 0


def tune(table: Table, bw: float, started: float, max_seconds: float) -> int:
    """Each variant of the default tiles on a few decode cases; prints the best per case."""
    table.line("# tile tuning (decode): candidates for block_sizes.TUNED")
    table.header()
    failures = 0
    for shape in tune_sweep():
        from pallas_kernels.benchmark import make_case
        case = make_case(shape)
        base = block_sizes_for(case.q.shape, shape.kv_heads, case.page_table.shape,
                               shape.page_size)
        best = None
        for sizes in tuning_variants(base):
            if time.perf_counter() - started > max_seconds:
                table.line("# stopped: --max-seconds reached")
                return failures
            try:
                row = bench_shape(shape, ["pallas"], bw, sizes=sizes)
            except Exception as e:
                failures += 1
                table.line(f"# {shape.name} {sizes}: FAILED {type(e).__name__}: {str(e)[:200]}")
                continue
            table.row(row)
            if best is None or row["pallas_ms"] < best[0]:
                best = (row["pallas_ms"], sizes)
        if best:
            table.line(f"# best for {shape.name}: {best[1]} ({best[0]:.3f} ms; default "
                       f"{base})")
    return failures


if __name__ == "__main__":
    sys.exit(main())
