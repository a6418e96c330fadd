"""The language model inside a vision-language checkpoint, served text only: its
config.json's `text_config` as the text family's config, and its tensors under
`model.language_model.` as that family's (the vision tower's, under `model.visual.`, are
not read). Qwen3.5's checkpoints (Qwen/Qwen3.5-*) are of this kind."""
from __future__ import annotations

# the checkpoint's architecture -> its language model's
TEXT_ARCHITECTURES = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}
_LANGUAGE, _VISUAL = "model.language_model.", "model.visual."


def text_config(hf: dict) -> dict:
    """config.json -> the text model's config (unchanged for a text checkpoint)."""
    archs = hf.get("architectures") or []
    if not archs or archs[0] not in TEXT_ARCHITECTURES:
        return hf
    text = dict(hf.get("text_config") or {})
    if not text:
        raise ValueError(f"{archs[0]}'s config.json has no text_config")
    text["architectures"] = [TEXT_ARCHITECTURES[archs[0]]]
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    if "quantization_config" in hf:
        text.setdefault("quantization_config", hf["quantization_config"])
    return text


def text_tensor(name: str) -> str | None:
    """A checkpoint tensor's name as the text model's, or None for the vision tower's."""
    if name.startswith(_VISUAL):
        return None
    if name.startswith(_LANGUAGE):
        return "model." + name[len(_LANGUAGE):]
    return name
