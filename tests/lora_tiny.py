"""Tiny PEFT LoRA adapters with random non-zero A and B over tiny transformers models, and
their greedy references (the oracle of tests/test_lora*.py)."""
import copy
from pathlib import Path

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> LoraConfig keywords: ranks, alphas and targets differ; one rsLoRA, one with rank
# and alpha patterns, one at max_lora_rank 16.
ADAPTERS = {
    "sql": dict(r=8, lora_alpha=16, target_modules=ALL),
    "poet": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj",
                                                                     "down_proj"]),
    "chat": dict(r=16, lora_alpha=24, target_modules=["q_proj", "k_proj", "o_proj",
                                                      "gate_proj", "up_proj"],
                 rank_pattern={"o_proj": 2}, alpha_pattern={"gate_proj": 5}),
}
SIZE = 0.15  # A and B scaled from PEFT's random init: outputs move, but not to one token


def make_adapter(base, name: str, out_dir: Path, seed: int = 0, size: float = SIZE, **overrides):
    """Saves a PEFT adapter over a copy of `base` (random A and B) and returns that model."""
    import torch
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(
        **{**ADAPTERS[name], **overrides}, init_lora_weights=False))
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "lora_" in key:
                p.mul_(size)
    model.save_pretrained(out_dir)
    return model.eval()
