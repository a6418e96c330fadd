"""A vLLM user's command line: `xlaserve serve MODEL`, vLLM's flag names, --version, defaults
in --help, Hugging Face model ids from the local cache, and --dtype auto."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from serving.cli import _engine_config, build_parser, main
from serving.core.model_source import ModelNotFoundError, resolve_model_source
from serving.engine.sizing import resolve_dtype

ROOT = Path(__file__).resolve().parents[1]


def parse(*argv):
    return _engine_config(build_parser().parse_args(list(argv)))


def test_model_positional_as_vllm_serve_and_as_flag():
    assert parse("serve", "org/name").model == "org/name"
    assert parse("serve", "--model", "org/name").model == "org/name"
    assert parse("serve").model is None
    with pytest.raises(SystemExit, match="two models"):
        parse("serve", "a/b", "--model", "c/d")


def test_vllm_flag_names():
    ec = parse("serve", "m", "--quantization", "fp8", "--gpu-memory-utilization", "0.8",
               "--kv-cache-memory", "20GiB")
    assert (ec.quantize, ec.gpu_memory_utilization, ec.kv_cache_memory) == ("fp8", 0.8,
                                                                            20 << 30)
    assert parse("serve", "m", "--quantize", "int8").quantize == "int8"
    defaults = parse("serve", "m")
    assert (defaults.dtype, defaults.gpu_memory_utilization, defaults.kv_cache_memory) == (
        "auto", 0.9, None)


def test_async_scheduling_as_vllm_names_it():
    assert parse("serve", "m", "--async-scheduling").async_scheduling is True
    assert parse("serve", "m", "--no-async-scheduling").async_scheduling is False
    assert parse("serve", "m").async_scheduling is True


def test_tensor_parallel_size_as_vllm_names_it():
    assert parse("serve", "m", "--tensor-parallel-size", "4").tensor_parallel_size == 4
    assert parse("serve", "m", "-tp", "2").tensor_parallel_size == 2
    assert parse("serve", "m").tensor_parallel_size == 1


def test_several_processes_flags_as_jax_distributed_names_them():
    from serving.engine.multiprocess import DistributedConfigError, check
    ec = parse("serve", "m", "--coordinator-address", "10.0.0.1:9876", "--num-processes", "2",
               "--process-id", "1")
    assert (ec.coordinator_address, ec.num_processes, ec.process_id) == ("10.0.0.1:9876", 2, 1)
    assert check(ec.coordinator_address, ec.num_processes, ec.process_id) == ("10.0.0.1", 9876)
    assert check(None, 1, 0) is None
    for args, error in (((None, 2, 0), "needs --coordinator-address"),
                        (("h:1", 2, 2), r"process_id must be in 0\.\.1"),
                        (("nohost", 2, 0), "HOST:PORT"), (("h:1", 0, 0), "positive"),
                        (("h:1", 1, 0), "need --num-processes of 2")):
        with pytest.raises(DistributedConfigError, match=error):
            check(*args)


def test_kv_cache_memory_is_bytes_and_a_fraction_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse("serve", "m", "--kv-cache-memory", "0.5")
    assert "--gpu-memory-utilization" in capsys.readouterr().err


def test_empty_compilation_cache_dir_turns_the_cache_off():
    assert parse("serve", "--compilation-cache-dir", "").compilation_cache_dir == ""
    assert parse("serve").compilation_cache_dir.endswith("jax-cache")


def test_version_and_defaults_in_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("xlaserve 0.")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("requests running at once (default: 64)", "(default: 0.9)",
                  "tokens per KV page (default: 16)", "(default: auto)", "(default: 8000)"):
        assert shown in text, shown


def test_cli_starts_without_jax_for_help():
    code = ("import sys; from serving.cli import build_parser; build_parser(); "
            "sys.exit('jax' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def _hub_snapshot(hub: Path, model_id: str, revision: str = "abc123") -> Path:
    repo = hub / ("models--" + model_id.replace("/", "--"))
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snap


def test_model_id_resolves_from_the_local_hugging_face_cache(tmp_path):
    snap = _hub_snapshot(tmp_path / "hf" / "hub", "meta-llama/Llama-3.1-8B-Instruct")
    _hub_snapshot(tmp_path / "hf" / "hub", "meta-llama/Other", "def456")
    env = {"HF_HOME": str(tmp_path / "hf")}
    assert resolve_model_source("meta-llama/Llama-3.1-8B-Instruct", environ=env) == snap
    hub_env = {"HF_HUB_CACHE": str(tmp_path / "hf" / "hub")}
    assert resolve_model_source("meta-llama/Llama-3.1-8B-Instruct", environ=hub_env) == snap
    folder = tmp_path / "local"
    folder.mkdir()
    assert resolve_model_source(str(folder), environ=env) == folder  # folders first


def test_a_model_id_missing_from_the_cache_is_a_clear_error(tmp_path):
    env = {"HF_HOME": str(tmp_path)}
    with pytest.raises(ModelNotFoundError, match="nor in the Hugging Face cache.*download"):
        resolve_model_source("meta-llama/Llama-3.1-8B-Instruct", environ=env)


def test_serve_with_a_missing_model_id_exits_with_the_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert main(["serve", "nobody/no-such-model"]) == 1
    assert "nor in the Hugging Face cache" in capsys.readouterr().err


@pytest.mark.parametrize("torch_dtype,on_gpu,expected", [
    ("float32", True, "bfloat16"), ("bfloat16", True, "bfloat16"),
    ("float16", True, "float16"), (None, True, "bfloat16"),
    ("float32", False, None), ("bfloat16", False, None),  # off-GPU: the checkpoint's
])
def test_dtype_auto_follows_vllm(tmp_path, torch_dtype, on_gpu, expected):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": torch_dtype}))
    assert resolve_dtype("auto", tmp_path, on_gpu) == expected
    assert resolve_dtype(None, tmp_path, on_gpu) == expected
    assert resolve_dtype("float16", tmp_path, on_gpu) == "float16"
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float64", tmp_path, on_gpu)


def _setup(tmp_path, nvidia_smi: str | None, extra=()):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if nvidia_smi is not None:
        tool = bin_dir / "nvidia-smi"
        tool.write_text(f"#!/bin/sh\n{nvidia_smi}\n")
        tool.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "XLASERVE_SETUP_DRY_RUN": "1"}
    return subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), *extra], env=env,
                          capture_output=True, text=True, check=True).stdout


def test_setup_installs_the_cuda_extra_where_nvidia_smi_reports_a_gpu(tmp_path):
    out = _setup(tmp_path, "echo 'NVIDIA H200'", ["test"])
    assert "NVIDIA GPU found (NVIDIA H200)" in out and "would install .[test,cuda12]" in out


def test_setup_stays_on_cpu_without_a_gpu(tmp_path):
    assert "would install .[]" in _setup(tmp_path, None)
    out = _setup(tmp_path, "exit 9")  # nvidia-smi present, no driver or no GPU
    assert "no NVIDIA GPU" in out and "would install .[]" in out


def test_jax_compilation_cache_stays_off():
    """The executable cache (serving/engine/executable_cache.py) replaces JAX's persistent
    cache: the engine turns that one off, so no program it hands back gets saved."""
    import jax
    from serving.engine.runner import disable_jax_compilation_cache
    before = jax.config.jax_enable_compilation_cache
    try:
        jax.config.update("jax_enable_compilation_cache", True)
        disable_jax_compilation_cache()
        assert jax.config.jax_enable_compilation_cache is False
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
