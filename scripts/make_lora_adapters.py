"""Random PEFT LoRA adapters for a Hugging Face model folder, for benchmarks and demos:

    python scripts/make_lora_adapters.py MODEL_DIR OUT_DIR --count 8 --rank 16

writes OUT_DIR/lora0 ... lora{count-1}, each over every q/k/v/o/gate/up/down projection
(PEFT's random init for A and B, scaled down so answers stay near the base's) and prints
the `--lora-modules` arguments that serve them. Needs torch and peft (the test extra)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("out_dir")
    p.add_argument("--count", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32)
    p.add_argument("--scale", type=float, default=0.05, help="A and B multiplied by this")
    args = p.parse_args(argv)
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    config = LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=TARGETS,
                        init_lora_weights=False)
    names = []
    for i in range(args.count):
        torch.manual_seed(i)
        model = get_peft_model(copy.deepcopy(base), config)
        with torch.no_grad():
            for key, weight in model.named_parameters():
                if "lora_" in key:
                    weight.uniform_(-1, 1).mul_(args.scale)
        folder = Path(args.out_dir).resolve() / f"lora{i}"
        model.save_pretrained(folder)
        names.append(f"lora{i}={folder}")
        del model
    print("--enable-lora --max-loras", args.count, "--max-lora-rank", args.rank,
          "--lora-modules", " ".join(names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
