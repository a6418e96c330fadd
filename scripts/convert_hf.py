"""Convert a Hugging Face model folder into an xlaserve checkpoint folder.

usage: python scripts/convert_hf.py HF_DIR OUT_DIR [--dtype bfloat16|float32] [--quantize int8|fp8]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("hf_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default=None,
                    help="weight dtype (default: the checkpoint's torch_dtype)")
    ap.add_argument("--quantize", default=None, metavar="int8|fp8",
                    help="store quantized weights: int8 (per channel), fp8 (per tensor, for "
                         "the fp8 GEMM) or a recipe such as fp8:channel, int8:embed,lm_head")
    args = ap.parse_args(argv)
    from model.checkpoint import convert_hf
    try:
        meta = convert_hf(args.hf_dir, args.out_dir, args.dtype, quantize=args.quantize)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    q = meta["quantization"]
    scheme = "" if q == "none" else f", {q['scheme']} per {q['granularity']}"
    print(f"wrote {args.out_dir} ({meta['model_config']['architecture']}, {meta['dtype']}"
          f"{scheme}) in {meta['convert_seconds']} s")
    size, bf16 = meta["weight_bytes"], meta["bf16_bytes"]
    disk = _disk_bytes(Path(args.out_dir) / "params")
    print(f"weights {size / 2**20:.1f} MiB ({size / bf16:.0%} of bfloat16's "
          f"{bf16 / 2**20:.1f} MiB); on disk {disk / 2**20:.1f} MiB")
    return 0


def _disk_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


if __name__ == "__main__":
    sys.exit(main())
