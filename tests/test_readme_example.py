"""The quick start's own request (README.md) answered in the demo's default CPU
configuration (docs/architecture.md, "Defaults on a CPU"), with the default buckets: the
answer the README prints, which is the one transformers gives on the weights as converted."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers

from serving import LLM, SamplingParams
from serving.engine import demo_defaults

README = Path(__file__).resolve().parents[1] / "README.md"


def quick_start() -> tuple[dict, str]:
    """(the curl's JSON body, the answer the README says it gives)."""
    text = README.read_text()
    body = json.loads(re.search(r"-d '(\{.*?\})'", text).group(1))
    answer = re.search(r'The deltas put together read: "(.*?)"', text).group(1)
    return body, answer


@pytest.mark.slow
def test_the_default_configuration_gives_the_answer_the_readme_prints(
        demo_checkpoint, demo_model_dir):
    body, answer = quick_start()
    assert body["temperature"] == 0 and body["max_tokens"] <= 256
    llm = LLM(str(demo_checkpoint), quantize=demo_defaults.CPU_DEMO_QUANTIZE,
              kv_cache_dtype=demo_defaults.CPU_DEMO_KV_CACHE_DTYPE,
              progress=False)
    tok = llm.tokenizer
    prompt = tok.encode(tok.apply_chat_template(body["messages"], tokenize=False,
                                                add_generation_prompt=True),
                        add_special_tokens=False)  # as the chat route does
    out = llm.generate([prompt], SamplingParams(temperature=0.0,
                                                max_tokens=body["max_tokens"]))[0]
    assert out.finish_reason == "stop", out.text  # it ends; it does not ramble to the limit
    assert out.text.strip() == answer

    model = transformers.AutoModelForCausalLM.from_pretrained(demo_model_dir,
                                                              torch_dtype=torch.float32)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=body["max_tokens"],
                             do_sample=False)[0, len(prompt):]
    assert tok.decode(ref, skip_special_tokens=True).strip() == answer
