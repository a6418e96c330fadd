"""Compiled step programs saved to disk, so a restart loads them instead of tracing, lowering
and compiling each one again.

One file per program, `<slot>.xlx`, where the slot hashes what the program is for: the model
architecture and the avals of its arguments (weights, KV cache, step buffers), the attention
backend, the step shape and its buffer layout, the devices it runs on (one, or a mesh's, by
id), the device kind, the host CPU and XLA_FLAGS.
Weights are arguments, never constants, so two checkpoints of one architecture share their
programs. The file also records what the
program was built with (code version, jax and jaxlib versions, platform and device kind) and
a checksum of its bytes. On load:

- unreadable, truncated or failing its checksum: "corrupt";
- built by other code or another jax / jaxlib: "stale";
- for another model, shape, layout or device (a file copied or renamed by hand): "foreign";

each is logged and compiled again (the new program replaces the file), never a crash and
never a wrong program. A loaded program's argument avals are checked against the arguments
it is about to get. The folder is kept under `max_bytes` by removing the least recently used
files.

Loading runs code from the file (pickle), so the folder must be as trusted as the code.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pickle
import platform
import struct
import tempfile
from pathlib import Path

import jax
import jaxlib
from jax.experimental.serialize_executable import deserialize_and_load, serialize

from pallas_kernels import cpu_build, cpu_ffi

log = logging.getLogger("xlaserve")

MAGIC = b"XLASERVE-EXEC\x01"
SUFFIX = ".xlx"
DEFAULT_MAX_BYTES = 4 << 30
_ROOT = Path(__file__).resolve().parents[2]
# The sources a step program is traced from (the step's input shapes and layout are part of
# each key, so input_prep and the scheduler are not).
_CODE = ("model", "pallas_kernels", "quant", "serving/engine/runner.py",
         "serving/engine/sampler.py", "serving/engine/prompt_logprobs.py",
         "serving/engine/pooling.py", "serving/engine/rejection_sampler.py",
         "serving/engine/token_bitmask.py", "serving/engine/draft_model.py",
         "serving/engine/mtp_drafter.py", "serving/engine/executable_cache.py")


@functools.cache
def code_version() -> str:
    """A hash of the sources the step programs are traced from (Python and C++)."""
    h = hashlib.sha256()
    for name in _CODE:
        top = _ROOT / name
        for path in sorted(top.rglob("*")) if top.is_dir() else [top]:
            if path.suffix in (".py", ".cc", ".h") and "__pycache__" not in path.parts:
                h.update(str(path.relative_to(_ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def build_versions() -> dict:
    device = jax.devices()[0]
    return dict(code=code_version(), jax=jax.__version__, jaxlib=jaxlib.__version__,
                platform=device.platform, device_kind=device.device_kind)


@functools.cache
def _host() -> str:
    """XLA:CPU compiles for the host's instruction set, and XLA_FLAGS change what it makes:
    a program from another machine or other flags is another slot."""
    text = platform.machine() + cpu_build.cpu_signature() + os.environ.get("XLA_FLAGS", "")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def avals_signature(tree) -> str:
    """Structure, shapes and dtypes of a pytree of arrays (not their values)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    text = str(treedef) + "".join(f"{tuple(x.shape)}{x.dtype}" for x in leaves)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class ExecutableCache:
    def __init__(self, root: str | Path, identity: dict, max_bytes: int = DEFAULT_MAX_BYTES,
                 devices: list | None = None):
        """identity: JSON-able description of what every program here is for (model
        architecture, argument avals, backend); each program adds its shape and layout.
        devices: the ones the programs run on, in their mesh's order (default: the first);
        a saved program is bound to them."""
        self.root = Path(root)
        self.devices = list(devices) if devices else jax.devices()[:1]
        self.identity = dict(identity, devices=[d.id for d in self.devices])
        self.max_bytes = max_bytes
        self.versions = build_versions()

    def _slot(self, shape, layout) -> tuple[dict, Path]:
        key = dict(self.identity, shape=list(shape), layout=repr(layout),
                   device_kind=self.versions["device_kind"],
                   platform=self.versions["platform"], host=_host())
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        return key, self.root / f"{digest}{SUFFIX}"

    def load(self, shape, layout, args):
        """The saved program for this shape, or None (missing, or logged as unusable)."""
        key, path = self._slot(shape, layout)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            return self._unusable(path, "corrupt", f"unreadable: {e}")
        try:
            header, payload = _split(blob)
        except ValueError as e:
            return self._unusable(path, "corrupt", str(e))
        if header.get("key") != key:
            return self._unusable(path, "foreign", "made for another model, shape or device")
        if header.get("versions") != self.versions:
            return self._unusable(path, "stale", f"built by {header.get('versions')}")
        for kernel in header.get("ffi", ()):
            if not cpu_ffi.available(kernel):  # registered before the program loads
                return self._unusable(path, "foreign", f"needs the CPU kernel {kernel}")
        try:
            serialized, in_tree, out_tree = pickle.loads(payload)
            # on the devices its programs run on (not every device of the process, which
            # a process with several devices would otherwise make it expect)
            program = deserialize_and_load(serialized, in_tree, out_tree,
                                           execution_devices=self.devices)
        except Exception as e:  # noqa: BLE001 - any failure to load means: compile it
            return self._unusable(path, "corrupt", f"{type(e).__name__}: {e}")
        if not _accepts(program, args):
            return self._unusable(path, "foreign", "its argument types differ")
        os.utime(path)  # recently used: pruned last
        return program

    def save(self, shape, layout, program) -> None:
        """Writes the program (atomically), then prunes the folder. Never raises: a program
        that cannot be saved is compiled again next time."""
        if jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir:
            # A program JAX's own persistent cache handed back does not survive a second
            # round trip through serialization on XLA:CPU (it fails when run: "Function ...
            # not found"), and there is no telling which ones it handed back.
            _warn_once("JAX's persistent compilation cache is on (jax_compilation_cache_dir); "
                       "compiled programs are not saved to %s", self.root)
            return
        key, path = self._slot(shape, layout)
        try:
            serialized, in_tree, out_tree = serialize(program)
            payload = pickle.dumps((serialized, in_tree, out_tree))
            header = dict(key=key, versions=self.versions, ffi=list(cpu_ffi.loaded_kernels()),
                          sha256=hashlib.sha256(payload).hexdigest())
            head = json.dumps(header, sort_keys=True).encode()
            self.root.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.root, suffix=".tmp", delete=False) as f:
                f.write(MAGIC + struct.pack("<Q", len(head)) + head + payload)
            os.replace(f.name, path)
        except Exception as e:  # noqa: BLE001 - a full disk must not stop the server
            log.warning("could not save the compiled program %s to %s: %s: %s", tuple(shape),
                        self.root, type(e).__name__, e)
            return
        self.prune()

    def prune(self) -> None:
        """Removes the least recently used files until the folder fits max_bytes."""
        try:
            entries = [(p.stat().st_mtime, p.stat().st_size, p) for p in self.root.iterdir()
                       if p.suffix in (SUFFIX, ".tmp")]
        except OSError:
            return
        total = sum(size for _, size, _ in entries)
        for _, size, p in sorted(entries):
            if total <= self.max_bytes:
                break
            try:
                p.unlink()
                total -= size
            except OSError:
                pass  # another process removed it first

    def _unusable(self, path: Path, kind: str, why: str) -> None:
        log.warning("compiled-program cache: %s entry %s (%s); compiling it again", kind,
                    path.name, why)
        return None


def load_or_compile(executables: ExecutableCache | None, lower, args, shape, layout
                    ) -> tuple[object, bool]:
    """(program, loaded): from the cache when it has one for these arguments, else
    lower().compile() (lower is called on a miss only), saved there. No cache: compiled."""
    program = executables.load(shape, layout, args) if executables else None
    if program is not None:
        return program, True
    program = lower().compile()
    if executables:
        executables.save(shape, layout, program)
    return program, False


def program_for(compiled: dict, shape, layout, what: str):
    """compiled: shape -> (program, layout) made at warm-up. The program for `shape`, checked
    to take arguments laid out as `layout`."""
    entry = compiled.get(shape)
    if entry is None:
        raise RuntimeError(f"{what} shape {shape} was not compiled at warm-up")
    program, expected = entry
    if layout != expected:
        raise RuntimeError(f"{what} arrays of shape {shape} do not match its program")
    return program


@functools.cache
def _warn_once(message: str, *args) -> None:
    log.warning(message, *args)


def _split(blob: bytes) -> tuple[dict, bytes]:
    if not blob.startswith(MAGIC):
        raise ValueError("not a saved program")
    at = len(MAGIC)
    if len(blob) < at + 8:
        raise ValueError("truncated")
    (n,) = struct.unpack("<Q", blob[at:at + 8])
    head, payload = blob[at + 8:at + 8 + n], blob[at + 8 + n:]
    try:
        header = json.loads(head)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("unreadable header") from None
    if not isinstance(header, dict) or hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise ValueError("checksum mismatch")
    return header, payload


def _accepts(program, args) -> bool:
    """Whether a loaded program takes exactly these arguments (tree, shapes, dtypes)."""
    want, want_tree = jax.tree_util.tree_flatten((tuple(args), {}))
    got, got_tree = jax.tree_util.tree_flatten(program.args_info)
    if want_tree != got_tree or len(want) != len(got):
        return False
    return all(tuple(a.shape) == tuple(g.shape) and a.dtype == g.dtype for a, g in zip(want, got))

