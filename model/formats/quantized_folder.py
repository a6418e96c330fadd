"""A Hugging Face folder whose linear layers are stored quantized (compressed-tensors, GPTQ,
AWQ, fp8 with block scales): the walk every such format shares, and what their readers share.

Each format module's `make_reader(qc, cfg)` checks the config and returns a `LinearReader`:
given one linear module's tensors (`ModuleTensors` of `model.layers.3.self_attn.q_proj`, or of
one expert's `model.layers.3.mlp.experts.5.up_proj`), it returns that weight in one of our
forms, [in, out] (quant.array.QuantArray, quant.int4.Int4Array, ...) or a float array, or None when the module is stored as a plain
`.weight` (an ignored layer, the head). Norms, biases and the embedding are read as the float
loader reads them. A tensor nobody claims is an error: a packed integer tensor must never be
read as if it were a float weight.

The files are read here rather than through the safetensors package, whose numpy reader knows
no float8; a damaged file is refused naming the tensor it cuts off.
"""
from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import ml_dtypes
import numpy as np

from model.config import ModelConfig
from model.formats import FormatError
from model.formats.int_groups import to_our_form
from model.formats.param_tree import ParamFiller
from model import latent_weights
from model.hf_weights import _IGNORED, WeightsError, _locate, _target, safetensors_files
from quant.recipe import FLOAT_KERNELS


# safetensors dtype names -> numpy (ml_dtypes for the ones numpy lacks)
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
           "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_}
# the float dtypes a plain weight, a bias or a scale may have (bfloat16 is no np.floating)
FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})

Getter = Callable[[], np.ndarray]


class ModuleTensors:
    """One linear module's tensors by suffix, read with the checks every format needs."""

    def __init__(self, prefix: str, getters: dict[str, Getter], shape: tuple[int, int]):
        self.prefix = prefix
        self.getters = getters
        self.shape = shape  # (in, out): the kernel the model declares

    def __contains__(self, suffix: str) -> bool:
        return suffix in self.getters

    def error(self, message: str) -> WeightsError:
        return WeightsError(f"{self.prefix}: {message}")

    def only(self, allowed, describe: str) -> None:
        extra = sorted(set(self.getters) - set(allowed))
        if extra:
            raise self.error(f"tensors {extra} are not part of a {describe} layer")

    def get(self, suffix: str, shape=None, kind: str | None = None) -> np.ndarray:
        """kind: "float", "int" or a dtype name the tensor must have; shape: the one it must."""
        if suffix not in self.getters:
            raise self.error(f"tensor {suffix!r} is missing")
        a = self.getters[suffix]()
        name = np.dtype(a.dtype).name
        ok = (kind is None or name == kind or (kind == "float" and name in FLOATS)
              or (kind == "int" and np.issubdtype(a.dtype, np.integer)))
        if not ok:
            raise self.error(f"{suffix} is stored as {name} where a {kind} tensor belongs")
        if shape is not None and tuple(a.shape) != tuple(shape):
            k, n = self.shape
            raise self.error(f"{suffix} has shape {tuple(a.shape)}; a layer of {k} inputs and "
                             f"{n} outputs stores it as {tuple(shape)}")
        return a

    def scale(self, suffix: str, shape=None) -> np.ndarray:
        """A float tensor as float32: exact for the 16-bit floats checkpoints store."""
        a = self.get(suffix, shape, "float")
        out = a.astype(np.float32)
        if not np.array_equal(out.astype(a.dtype), a, equal_nan=True):
            raise self.error(f"{suffix} ({a.dtype}) is not exact in float32")
        return out


class LinearReader(Protocol):
    notes: list[str]  # said once in the log: how activations run, what fell back to float

    def __call__(self, module: ModuleTensors) -> object: ...


def refuse(method: str, field: str, value, why: str = "") -> FormatError:
    return FormatError(f"quant_method {method!r}: {field} = {value!r} is not served"
                       + (f" ({why})" if why else ""))


def check_fields(config: dict, method: str, known, where: str = "") -> None:
    """A field we do not know is refused unless empty: it might change the numbers. `where`:
    the config's path inside quantization_config, for the message."""
    for key, value in config.items():
        if key not in known and value not in (None, False, "", [], {}):
            raise refuse(method, f"{where}.{key}" if where else key, value,
                         "an unknown field; refusing rather than guessing what it does to "
                         "the weights")


def unpack_int32(words: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
    """Codes packed 32 // bits to an int32 word along `axis`, element j at bits j * bits
    (AWQ's `order`: the element each successive field holds) -> uint8 codes, the axis
    32 // bits times longer (pad codes included)."""
    per = 32 // bits
    u = np.ascontiguousarray(np.moveaxis(words, axis, -1)).view(np.uint32)
    fields = [(u >> np.uint32(bits * j)) & np.uint32((1 << bits) - 1) for j in range(per)]
    codes = np.stack(fields, axis=-1)
    if order is not None:
        codes = codes[..., np.argsort(order)]
    codes = codes.reshape(*u.shape[:-1], u.shape[-1] * per).astype(np.uint8)
    return np.moveaxis(codes, -1, axis)


def linear_path(prefix: str) -> tuple[tuple[str, ...], int | None, int | None] | None:
    """A linear module's prefix -> (its kernel's path, layer or None, expert or None), or None:
    the layers' projections, a mixture's experts (a module each, `experts.E.`, their kernels
    stacked [E, in, out] by the filler) and the head. A router stays a plain tensor."""
    found = _locate(prefix + ".weight")
    if found is None:
        return None
    path, layer, expert, transpose = found
    if not transpose or path[-1] != "kernel" or path[-2] in FLOAT_KERNELS:
        return None
    return path, layer, expert


def file_tensors(file: Path) -> dict[str, Getter]:
    """A safetensors file's tensors, each read (memory-mapped) when its getter is called."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= size - 8:
            raise WeightsError(f"{file.name} is not a readable safetensors file (truncated or "
                               "corrupt header)")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise WeightsError(f"{file.name} is not a readable safetensors file (its header "
                               "is not JSON)") from None
    header.pop("__metadata__", None)
    data = np.memmap(file, np.uint8, "r") if size > 8 + length else np.zeros(0, np.uint8)
    getters = {}
    for name, info in header.items():
        dtype, shape, (begin, end) = _describe(file, name, info)
        count = int(np.prod(shape))
        if end - begin != count * np.dtype(dtype).itemsize:
            raise WeightsError(f"{file.name}: tensor {name!r} holds {end - begin} bytes, not "
                               f"the {count} {np.dtype(dtype).name} values of shape {shape}")
        if 8 + length + end > size:
            raise WeightsError(f"{file.name} is truncated: tensor {name!r} ends at byte "
                               f"{8 + length + end} of a {size}-byte file")
        getters[name] = (lambda d, c, o, s: lambda: np.frombuffer(
            data, d, c, o).reshape(s))(dtype, count, 8 + length + begin, shape)
    return getters


def _describe(file: Path, name: str, info) -> tuple:
    try:
        dtype, shape, offsets = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        begin, end = (int(x) for x in offsets)
    except (KeyError, TypeError, ValueError):
        raise WeightsError(f"{file.name}: tensor {name!r} has a malformed header entry") \
            from None
    if dtype not in _DTYPES:
        raise WeightsError(f"{file.name}: tensor {name!r} has dtype {dtype}, which we do not "
                           "read")
    return _DTYPES[dtype], shape, (begin, end)


def _folder_tensors(folder: Path) -> dict[str, Getter]:
    getters: dict[str, Getter] = {}
    for file in safetensors_files(folder):
        for name, get in file_tensors(file).items():
            if name in getters:
                raise WeightsError(f"tensor {name!r} appears in two files")
            getters[name] = get
    return getters


def _plain_weight(module: ModuleTensors, describe: str) -> np.ndarray:
    module.only({"weight", "bias"}, f"plain {describe}")
    k, n = module.shape
    return module.get("weight", (n, k), "float").T


def load_quantized_folder(folder: Path, cfg: ModelConfig, read_linear: LinearReader,
                          describe: str) -> tuple[dict, list[str]]:
    """-> (parameter tree of numpy leaves, log lines: the format and each kernel's form)."""
    getters = latent_getters(_folder_tensors(folder), cfg, describe, _block_rows(folder))
    by_module: dict[str, dict[str, Getter]] = defaultdict(dict)
    kv_b: dict[str, dict[str, Getter]] = defaultdict(dict)
    rest = []
    for name, get in getters.items():
        prefix, _, suffix = name.rpartition(".")
        if cfg.latent and latent_weights.KV_B.fullmatch(prefix + ".weight"):
            kv_b[prefix][suffix] = get
        elif linear_path(prefix) is not None:
            by_module[prefix][suffix] = get
        else:
            rest.append(name)
    filler = ParamFiller(cfg)
    forms: dict[str, set[str]] = defaultdict(set)
    for prefix, tensors in sorted(by_module.items()):
        path, layer, expert = linear_path(prefix)
        if path[0] == "lm_head" and cfg.tie_word_embeddings:
            continue  # a tied checkpoint may still store the (identical) head
        module = ModuleTensors(prefix, tensors, filler.declared(path)[-2:])
        value = read_linear(module)
        if value is None:
            value = _plain_weight(module, describe)
        filler.set(path, layer, value, prefix, expert)
        kind = path[0] if layer is None else path[-2]
        forms[kind if expert is None else f"experts' {kind}"].add(filler.describe(value))
        if "bias" in tensors:
            bias = module.get("bias", (module.shape[1],), "float")
            filler.set(path[:-1] + ("bias",), layer, bias, prefix + ".bias", expert)
    for prefix, tensors in sorted(kv_b.items()):
        _absorbed_projections(prefix, tensors, cfg, read_linear, describe, filler)
    for name in rest:
        target = _target(name, cfg)
        if target is None:
            if _IGNORED.match(name):
                continue
            raise WeightsError(f"unexpected tensor {name!r} in a {describe} checkpoint")
        path, layer, transpose = target
        value = getters[name]()
        if np.dtype(value.dtype).name not in FLOATS:
            raise WeightsError(f"tensor {name!r} is stored as {value.dtype} where a float "
                               "tensor belongs")
        filler.set(path, layer, value.T if transpose else value, name)
    params = filler.finish()
    log = [f"checkpoint format: {describe}"]
    log += [f"  {kind}: {', '.join(sorted(f))}" for kind, f in sorted(forms.items())]
    log += [f"  {note}" for note in [*getattr(read_linear, "notes", []), *filler.notes]]
    return params, log


def _block_rows(folder: Path) -> int | None:
    """The output rows a block scale covers (fp8's weight_block_size), else None."""
    import json
    config = json.loads((folder / "config.json").read_text())
    block = (config.get("quantization_config") or {}).get("weight_block_size")
    return int(block[0]) if block else None


def latent_getters(getters: dict[str, Getter], cfg: ModelConfig, describe: str,
                   block_rows: int | None = None) -> dict[str, Getter]:
    """A latent-attention model's tensors as the main layers take them: next-n prediction
    layers left out (speculative decoding's mtp reads them), and, where the rope dims come
    in interleaved pairs, the query and latent projections' rope rows put in rotate-half
    order as they are read (model/latent_weights.py). Their scales stay: each rope span
    lies inside one block of rows, which is checked."""
    if not cfg.num_mtp_layers and not cfg.rope_interleaved:
        return getters
    if cfg.rope_interleaved and block_rows and not latent_weights.rope_in_blocks(cfg, block_rows):
        raise WeightsError(f"a {describe} checkpoint whose rope rows cross its {block_rows}-row "
                           "scale blocks: their interleaved order cannot be undone in place")
    out = {}
    for name, get in getters.items():
        if latent_weights.is_mtp_layer(name, cfg):
            continue
        if latent_weights.deinterleave_rope(name, None, cfg, check=True) is not None:
            suffix = name.rpartition(".")[2]
            if suffix in ("weight_scale_inv", "weight_scale", "input_scale"):
                out[name] = get  # per block of rows, each rope span inside one
                continue
            if suffix not in ("weight", "bias"):
                raise WeightsError(f"tensor {name!r}: the interleaved rope rows of a {describe} "
                                   "checkpoint are not read (fp8 and float ones are)")
            get = (lambda g, n: lambda: latent_weights.deinterleave_rope(n, g(), cfg))(get, name)
        out[name] = get
    return out


def _absorbed_projections(prefix: str, tensors: dict, cfg: ModelConfig, read_linear,
                          describe: str, filler) -> None:
    """kv_b_proj, in whatever form it is stored, dequantized and split into each head's
    absorbed projections (kept in float, as the attention multiplies by them per head)."""
    from model.formats.param_tree import dequantize_np
    n = cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    module = ModuleTensors(prefix, tensors, (cfg.kv_lora_rank, n))
    value = read_linear(module)
    w = _plain_weight(module, describe) if value is None else dequantize_np(value)
    layer, parts = latent_weights.split_kv_b(prefix + ".weight", np.asarray(w).T, cfg)
    for path, part, _ in parts:
        filler.set(path, layer, part, prefix)


def int_form(module: ModuleTensors, codes, scale, zero, bits: int, g_idx=None,
             notes: list[str] | None = None):
    """int_groups.to_our_form with a bad g_idx or zero point told as the module's error; a
    grouping that lands in float32 is noted once."""
    try:
        value = to_our_form(codes, scale, zero, bits, g_idx)
    except ValueError as e:
        raise module.error(str(e)) from None
    if notes is not None and isinstance(value, np.ndarray):
        add_note(notes, f"{bits}-bit weights whose groups fit none of our integer forms "
                        "(act-order g_idx, groups not in runs of 32 inputs) are dequantized "
                        "at load")
    return value


def add_note(notes: list[str], line: str) -> None:
    if line not in notes:
        notes.append(line)
