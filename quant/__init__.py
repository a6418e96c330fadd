"""int8 / int4 / fp8 weights and KV cache.

quant.array   QuantArray (values + float32 scales, a pytree), quantize, dequantize
quant.int4    Int4Array (GGUF's Q4_1: 4-bit codes, a float16 scale and offset per 32 inputs)
quant.int8_groups  Int8GroupArray (GGUF's Q8_0 / Q6_K: int8 codes, a scale per 32 / 16 inputs;
                   Q5_1 / Q5_K / Q2_K: an offset per group too)
quant.fp8_blocks   Fp8BlockArray (DeepSeek-V3's fp8 with a scale per 128 x 128 block), its matmul
quant.ops     matmul and embedding lookup for plain or quantized weights
quant.recipe  Recipe (which weights, which scheme, which granularity), quantize_params
quant.hlo     what XLA:GPU made of a quantized matmul, and its speed (`python -m quant.hlo`)

How well a quantized model keeps its quality is measured in model.quality (it runs the model).
Submodules are imported explicitly: `quant.recipe` parses and validates recipes without JAX.
"""
