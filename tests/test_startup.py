"""Start-up: the default buckets compile one program per token bucket on backends with a
fixed page table, and nothing after warm-up; a restart loads every program from the
executable cache instead of tracing it; corrupt, stale and foreign entries are compiled
again (with a log line) and give the same tokens; the cache folder stays under its bound."""
from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from model.attention import FIXED_PAGE_TABLE
from model.checkpoint import convert_hf
from serving import LLM
from serving.engine.executable_cache import MAGIC, SUFFIX, ExecutableCache
from tests.demo_engine import greedy
from tests.hf_tiny import tiny_hf_model
from tests.startup_child import workload
from tests.test_engine import counting_compilations

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory, demo_model_dir):
    hf_dir = tmp_path_factory.mktemp("tiny-hf")
    tiny_hf_model("llama", hf_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(demo_model_dir / name, hf_dir / name)
    ckpt = hf_dir.with_name(hf_dir.name + "-ckpt")  # beside its own numbered folder
    convert_hf(hf_dir, ckpt, "float32", progress=False)
    return str(ckpt)


def test_default_buckets_compile_one_program_per_token_bucket_and_nothing_after(
        tiny_ckpt, tmp_path):
    llm = LLM(tiny_ckpt, progress=False, compilation_cache_dir=str(tmp_path))  # all defaults
    engine = llm.engine
    b = engine.buckets
    if engine.attention_backend in FIXED_PAGE_TABLE:
        assert b.pages == (-(-engine.max_model_len // engine.config.page_size),)
        assert len(engine.step_shapes) == len(b.tokens) <= 12
    assert engine.runner.num_compiled == len(engine.step_shapes)
    with counting_compilations() as events:
        workload(llm, random.Random(0))
        llm.generate([[5] * 200] * 4, greedy(2))  # 800 prompt tokens: over the 512 budget
    assert events == []


def entries(folder):
    return sorted((folder / "executables").glob(f"*{SUFFIX}"))


def read_entry(path):
    blob = path.read_bytes()
    n = struct.unpack("<Q", blob[len(MAGIC):len(MAGIC) + 8])[0]
    start = len(MAGIC) + 8
    return json.loads(blob[start:start + n]), blob[start + n:]


def write_entry(path, header, payload):
    head = json.dumps(header, sort_keys=True).encode()
    path.write_bytes(MAGIC + struct.pack("<Q", len(head)) + head + payload)


def start(ckpt, folder) -> tuple[dict, str]:
    """One engine start in a new process: (its JSON report, its log)."""
    done = subprocess.run([sys.executable, "-m", "tests.startup_child", ckpt, str(folder)],
                          capture_output=True, text=True, timeout=1200,
                          env=dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent)))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_restart_loads_and_bad_entries_are_compiled_again(tiny_ckpt, tmp_path):
    cold, _ = start(tiny_ckpt, tmp_path)
    n = cold["programs"]
    assert (cold["compiled"], cold["loaded"]) == (n, 0)
    assert len(entries(tmp_path)) == n

    warm, _ = start(tiny_ckpt, tmp_path)
    assert (warm["loaded"], warm["compiled"]) == (n, 0)
    assert warm["events"] == []  # nothing traced, lowered or compiled
    assert warm["tokens"] == cold["tokens"]

    files = entries(tmp_path)
    files[0].write_bytes(files[0].read_bytes()[:-100])  # corrupt: cut short
    header, payload = read_entry(files[1])  # stale: built by other code, checksum intact
    write_entry(files[1], dict(header, versions=dict(header["versions"], code="0" * 16)),
                payload)
    shutil.copy(files[2], files[3])  # foreign: another shape's program under this name
    mixed, log = start(tiny_ckpt, tmp_path)
    assert (mixed["loaded"], mixed["compiled"]) == (n - 3, 3)
    for kind, f in (("corrupt", files[0]), ("stale", files[1]), ("foreign", files[3])):
        assert f"{kind} entry {f.name}" in log
    assert mixed["tokens"] == cold["tokens"]
    again, _ = start(tiny_ckpt, tmp_path)  # the bad entries were replaced by good ones
    assert again["loaded"] == n and again["tokens"] == cold["tokens"]


def test_cache_folder_is_kept_under_its_bound_least_recently_used_first(tmp_path):
    cache = ExecutableCache(tmp_path, {}, max_bytes=2500)
    for i in range(5):  # 5 x 1000 bytes, oldest first
        p = tmp_path / f"{i}{SUFFIX}"
        p.write_bytes(b"x" * 1000)
        os.utime(p, (1000 + i, 1000 + i))
    os.utime(tmp_path / f"1{SUFFIX}", (2000, 2000))  # used recently: kept
    (tmp_path / "other.txt").write_bytes(b"y" * 5000)  # not ours: left alone
    cache.prune()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"1{SUFFIX}", f"4{SUFFIX}",
                                                          "other.txt"]

