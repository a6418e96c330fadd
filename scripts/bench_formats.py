"""A step of checkpoints served as downloaded against the same weights in our own forms: the
demo's GGUF file against the demo folder quantized at load (int4, int4 with an int8 head),
a GPTQ-int4 (group 128) and a compressed-tensors FP8-dynamic copy of the demo against
`--quantize int4` and `--quantize fp8:channel`. They share kernels, so the times should
agree within noise; each row is scripts/bench_step.py's best step.

    python scripts/bench_formats.py [--shapes 1x1x16,16x16x16,64x64x16] [--out DIR]

Needs the test extra (torch, compressed-tensors): the copies are written by the tests'
checkpoint writers (tests/quantized_tiny.py) from the demo's float weights.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_copies(demo: Path, out: Path) -> dict[str, Path]:
    import torch
    from transformers import AutoModelForCausalLM

    from tests.quantized_tiny import write_compressed_tensors, write_gptq
    model = AutoModelForCausalLM.from_pretrained(str(demo), dtype=torch.float32)
    fp8 = dict(num_bits=8, type="float")
    copies = {"gptq": write_gptq(model, out / "gptq-int4-g128", bits=4, group_size=128)[0],
              "ct-fp8": write_compressed_tensors(
                  model, out / "ct-fp8-dynamic", dict(fp8, strategy="channel"),
                  "float-quantized", dict(fp8, strategy="token", dynamic=True))[0]}
    for folder in copies.values():  # the writers keep config and weights, not the tokenizer
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (demo / name).is_file():
                (folder / name).write_bytes((demo / name).read_bytes())
    return copies


def step_times(model: Path, quantize: str | None, shapes: str) -> list[float]:
    """Best ms of each shape, from scripts/bench_step.py in a process of its own."""
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_step.py"), "--model", str(model),
           "--shapes", shapes, "--kv-cache-dtype", "float32"]
    if quantize:
        cmd += ["--quantize", quantize]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = re.findall(r"^\| \d+ \| \d+ \| \d+ \| [\d.]+ \| ([\d.]+) \|", out, re.M)
    return [float(r) for r in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1x1x16,16x16x16,64x64x16")
    ap.add_argument("--out", type=Path, default=None, help="where the copies go (default: tmp)")
    args = ap.parse_args()
    from model.demo import cache_dir, demo_gguf_path, fetch_demo_model
    demo = fetch_demo_model(cache_dir() / "SmolLM2-135M-Instruct")
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-formats-"))
    copies = write_copies(demo, out)
    rows = [("GGUF Q4_1 file, as stored", demo_gguf_path(), None),
            ("demo folder --quantize int4", demo, "int4"),
            ("demo folder --quantize int4:lm_head", demo, "int4:lm_head"),
            ("GPTQ-int4 g128, as stored", copies["gptq"], None),
            ("compressed-tensors FP8-dynamic, as stored", copies["ct-fp8"], None),
            ("demo folder --quantize fp8:channel", demo, "fp8:channel")]
    shapes = args.shapes.split(",")
    print("| weights | " + " | ".join(f"{s} (ms)" for s in shapes) + " |")
    print("|---|" + "---:|" * len(shapes))
    for name, model, quantize in rows:
        times = step_times(model, quantize, args.shapes)
        print(f"| {name} | " + " | ".join(f"{t:.1f}" for t in times) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
