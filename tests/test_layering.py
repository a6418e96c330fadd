"""The layers import downwards only (docs/architecture.md, "Layers and rooms").

Packages: pallas_kernels < quant < model < serving. Inside serving, the rooms:
core (host-side scheduling) < multimodal (image fetching and decoding) < lora (adapters,
host side) < kv_transfer (prefill/decode disaggregation) < engine (device execution) < openai
(HTTP), with cli.py on top. `core`, `multimodal`, `lora` and `openai` import no JAX, so
their tests and the HTTP layer start in milliseconds.

Two checks: every import statement anywhere in a module (functions included) against the
direction, read from the source; and each module of the rooms without JAX imported alone in a
fresh interpreter, which must not load JAX (the transitive, module-level imports).
"""
import ast
import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["pallas_kernels", "quant", "model", "serving"]  # each may import those before it
ROOMS = ["core", "multimodal", "lora", "kv_transfer", "engine", "openai"]  # likewise, inside serving
NO_JAX_ROOMS = ["core", "multimodal", "lora", "openai"]


def modules(package: str) -> list[tuple[str, Path]]:
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out.append((name, path))
    return out


def imported_names(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def rank(name: str) -> tuple[int, int] | None:
    """(package rank, room rank) of a project module name; None outside the project."""
    parts = name.split(".")
    if parts[0] not in ORDER:
        return None
    room = ROOMS.index(parts[1]) if parts[0] == "serving" and len(parts) > 1 and parts[1] in ROOMS \
        else len(ROOMS)  # serving/__init__, cli, __main__: above every room
    return ORDER.index(parts[0]), room if parts[0] == "serving" else 0


def violations() -> list[str]:
    bad = []
    for package in ORDER:
        for name, path in modules(package):
            mine = rank(name)
            for target in imported_names(path):
                theirs = rank(target)
                if theirs is None:
                    continue
                if theirs[0] > mine[0] or (theirs[0] == mine[0] == ORDER.index("serving")
                                           and theirs[1] > mine[1]):
                    bad.append(f"{name} imports {target}")
    return bad


def test_imports_point_down_the_layers():
    assert violations() == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    # Negative control: a core module importing the engine is reported.
    fake = tmp_path / "serving" / "core"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("def f():\n    from serving.engine.runner import ModelRunner\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "ORDER", ["serving"])
    assert violations() == ["serving.core.bad imports serving.engine.runner",
                            "serving.core.bad imports serving.engine.runner.ModelRunner"]


CHECK = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(m for m in ("jax", "jaxlib", "flax") if m in sys.modules)))
"""


@pytest.mark.parametrize("room", NO_JAX_ROOMS)
def test_room_imports_no_jax(room):
    names = [name for name, _ in modules(f"serving/{room}")]
    assert len(names) >= 3  # the room was found
    def check(name):  # one fresh interpreter per module: another's imports cannot hide it
        return subprocess.run([sys.executable, "-c", CHECK, name], cwd=ROOT,
                              capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for name, proc in zip(names, pool.map(check, names)):
            assert proc.returncode == 0, proc.stderr
            assert json.loads(proc.stdout) == [], f"{name} loads JAX"
