"""Recipes: which weights are quantized, to what, at which granularity; and applying one to a
parameter tree. A recipe is recorded in the checkpoint's metadata (never in file names).

Spec strings (the `--quantize` flag, `LLM(quantize=...)`): a scheme, then optional
comma-separated options after a colon:

    int8                  every linear layer int8, per output channel (weight-only, W8A16)
    fp8                   every linear layer fp8 e4m3fn, per tensor, activations fp8 at run
                          time (W8A8): the pattern XLA:GPU turns into a cuBLASLt fp8 GEMM
    fp8:channel           fp8 weights per output channel, weight-only (no fp8 GEMM; the
                          convert fuses into the dot like int8's)
    fp8:block             fp8 weights with one scale per block of 128 inputs x 128 outputs
                          (amax / 448), DeepSeek-V3's form (quant/fp8_blocks.py): on GPUs
                          fp8 activations per row and 128 inputs, one fp8 dot per input
                          block; on CPUs weight-only, each block summed alone
    int4                  every linear layer 4-bit in groups of 32 inputs with a float16
                          scale and offset each (GGUF's Q4_1, quant/int4.py), weight-only
    int8:embed,lm_head    also the embedding table and the output head

Mixture-of-experts layers quantize every expert's kernels, each expert with scales of its
own (per channel, tensor or group of that expert); the router stays in the model's dtype.

The embedding and head are left in the model's dtype by default. When named, they are
quantized per row (= per output channel of the head), weight-only, whatever the layers'
granularity (int8 for an int4 recipe, as GGUF files keep theirs in 8 bits). With tied
embeddings they are one table: naming either quantizes it for both.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import partial

SCHEMES = ("int8", "fp8", "int4")
# Kernels a recipe leaves in the model's dtype: a mixture-of-experts router and its shared
# expert's gate, small matmuls whose outputs pick and weigh the experts.
FLOAT_KERNELS = ("router", "shared_expert_gate")
GRANULARITIES = ("channel", "tensor", "group", "block")
DEFAULT_GRANULARITY = {"int8": "channel", "fp8": "tensor", "int4": "group"}


@dataclass(frozen=True)
class Recipe:
    scheme: str  # "int8" | "fp8" | "int4"
    granularity: str  # "channel" | "tensor" | "group" (int4's, and only int4's) | "block" (fp8)
    embed: bool = False
    lm_head: bool = False

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown quantization scheme {self.scheme!r}; choose one of "
                             + ", ".join(SCHEMES))
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"unknown granularity {self.granularity!r}; choose one of "
                             + ", ".join(GRANULARITIES))
        if (self.scheme == "int4") != (self.granularity == "group") or (
                self.granularity == "block" and self.scheme != "fp8"):
            raise ValueError(f"{self.scheme} weights do not come per {self.granularity}: int4 "
                             "is per group of 32 inputs, int8 per channel or tensor, fp8 per "
                             "channel, tensor or block of 128 x 128")

    @property
    def activations(self) -> str:
        """fp8 per tensor quantizes activations too (the fp8 GEMM needs both sides in fp8);
        fp8 blocks per row and block of inputs (on GPUs, up to 64 rows)."""
        if self.scheme != "fp8" or self.granularity == "channel":
            return "none"
        return "fp8" if self.granularity == "tensor" else "fp8 per row and 128 inputs"

    @classmethod
    def parse(cls, spec: "str | Recipe") -> "Recipe":
        if isinstance(spec, Recipe):
            return spec
        scheme, _, opts = str(spec).strip().partition(":")
        options = {o.strip() for o in opts.split(",") if o.strip()}
        unknown = options - {*GRANULARITIES, "embed", "lm_head"}
        if unknown:
            raise ValueError(f"unknown quantization option(s) {sorted(unknown)} in {spec!r}; "
                             "options: channel, tensor, block, embed, lm_head")
        gran = [g for g in GRANULARITIES if g in options]
        if len(gran) > 1:
            raise ValueError(f"{spec!r} names both granularities")
        granularity = gran[0] if gran else DEFAULT_GRANULARITY.get(scheme, "channel")
        return cls(scheme, granularity, "embed" in options, "lm_head" in options)

    @property
    def spec(self) -> str:
        opts = [o for o, on in (("embed", self.embed), ("lm_head", self.lm_head)) if on]
        if self.granularity != DEFAULT_GRANULARITY[self.scheme]:
            opts.insert(0, self.granularity)
        return self.scheme + (":" + ",".join(opts) if opts else "")

    def to_dict(self) -> dict:
        """The checkpoint metadata's "quantization" entry."""
        return {**asdict(self), "activations": self.activations}

    @classmethod
    def from_dict(cls, d: dict) -> "Recipe":
        return cls(d["scheme"], d["granularity"], bool(d.get("embed")), bool(d.get("lm_head")))


def from_metadata(quantization) -> Recipe | None:
    """The metadata's "quantization" entry ("none" or a recipe dict) -> Recipe or None."""
    if quantization in (None, "none"):
        return None
    if not isinstance(quantization, dict):
        raise ValueError(f"unreadable quantization entry {quantization!r}")
    return Recipe.from_dict(quantization)


def _axes(path: tuple[str, ...], recipe: Recipe, tied: bool):
    """The axes one scale covers for the weight at `path`, or None to leave it alone."""
    tensor = recipe.granularity == "tensor"
    if path[-1] == "kernel" and path[0] == "layers":
        if path[-2] in FLOAT_KERNELS:
            return None
        # a stacked expert kernel [.., E, in, out] gets its scales per expert
        return (-2, -1) if tensor else (-2,)
    # The embedding and the head are always per row (= per output channel), weight-only: a
    # lookup wants per-row scales, and the logits gain nothing from the fp8 GEMM's per-tensor
    # form (SmolLM2-135M, tied table: perplexity +0.5% as int8, +5.0% as fp8 per row, +5.5%
    # as fp8 per tensor with fp8 activations).
    if path == ("lm_head", "kernel") and recipe.lm_head:
        return (-2,)
    if path == ("embed",) and (recipe.embed or (tied and recipe.lm_head)):
        return (-1,)  # per row = per output channel of the tied head
    return None


def quantize_params(params: dict, recipe: "Recipe | str") -> dict:
    """A parameter tree (of the model in model/) with the recipe's weights quantized
    (QuantArrays; Int4Arrays or Fp8BlockArrays for int4 and fp8:block layers).

    Works on concrete arrays (numpy or jax) and, under `jax.eval_shape`, on abstract ones.
    Each weight is quantized by its own jitted program, so peak memory is one weight more.
    """
    import jax

    from quant.array import storage_dtype
    from quant.int4 import is_quantized
    recipe = Recipe.parse(recipe)
    tied = "lm_head" not in params

    def one(path, leaf):
        if is_quantized(leaf):
            raise ValueError("these parameters are already quantized")
        names = tuple(getattr(p, "key", str(p)) for p in path)
        axes = _axes(names, recipe, tied)
        if axes is None:
            return leaf
        if recipe.scheme == "int4":  # layers in int4, the embedding and head in int8
            if names[0] == "layers":
                return _int4_jit()(leaf)
            return _quantize_jit(storage_dtype("int8"), axes)(leaf)
        if recipe.granularity == "block" and names[0] == "layers":
            return _fp8_blocks_jit()(leaf)
        return _quantize_jit(storage_dtype(recipe.scheme), axes)(leaf)

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_quantized)


_JITTED = {}


def _quantize_jit(dtype, axes):
    import jax

    from quant.array import quantize
    key = (str(dtype), axes)
    if key not in _JITTED:
        _JITTED[key] = jax.jit(partial(quantize, dtype=dtype, axes=axes))
    return _JITTED[key]


def _int4_jit():
    import jax

    from quant.int4 import quantize_int4
    if "int4" not in _JITTED:
        _JITTED["int4"] = jax.jit(quantize_int4)
    return _JITTED["int4"]


def _fp8_blocks_jit():
    import jax

    from quant.fp8_blocks import quantize_fp8_blocks
    if "fp8_blocks" not in _JITTED:
        _JITTED["fp8_blocks"] = jax.jit(quantize_fp8_blocks)
    return _JITTED["fp8_blocks"]


def abstract_quantized(abstract: dict, recipe: "Recipe | str") -> dict:
    """ShapeDtypeStruct tree -> the same with the recipe's weights as QuantArrays of structs."""
    import jax
    return jax.eval_shape(partial(quantize_params, recipe=recipe), abstract)


def describe(params) -> str:
    """'not quantized', or e.g. 'int8 per channel, 7 of 11 tensors': what a tree holds."""
    import jax

    from quant.fp8_blocks import Fp8BlockArray
    from quant.int4 import Int4Array, is_quantized
    from quant.int8_groups import Int8GroupArray
    leaves = jax.tree.leaves(params, is_leaf=is_quantized)
    quantized = [a for a in leaves if is_quantized(a)]
    if not quantized:
        return "not quantized"

    def name(a) -> str:
        if isinstance(a, Fp8BlockArray):
            return a.describe()
        if isinstance(a, Int8GroupArray):
            mins = "" if a.offset is None else " with mins"
            return f"{a.scheme} per group of {a.group}{mins}"
        if isinstance(a, Int4Array):
            return f"{a.scheme} per group of 32"
        return f"{a.scheme} per " + ("tensor" if a.per_tensor else "channel")
    schemes = sorted({name(a) for a in quantized})
    return f"{' + '.join(schemes)}, {len(quantized)} of {len(leaves)} tensors"
