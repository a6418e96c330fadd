"""LoRA adapters served over one base model (docs/architecture.md, "LoRA adapters"):
PEFT folders parsed on the host, kept in a CPU LRU and placed in the step's device slots."""
