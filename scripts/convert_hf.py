"""Convert a Hugging Face model folder into an xlaserve checkpoint folder.

usage: python scripts/convert_hf.py HF_DIR OUT_DIR [--dtype bfloat16|float32]
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
    args = ap.parse_args(argv)
    from model.checkpoint import convert_hf
    try:
        meta = convert_hf(args.hf_dir, args.out_dir, args.dtype)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out_dir} ({meta['model_config']['architecture']}, {meta['dtype']}) "
          f"in {meta['convert_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
