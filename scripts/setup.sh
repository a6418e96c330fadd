#!/usr/bin/env bash
# Creates .venv with a Python >= 3.12 (PATH first, then pyenv's versions) and installs the
# project. Where `nvidia-smi` reports a GPU the `cuda12` extra comes too (jaxlib's CUDA
# plugin), and the script says so; XLASERVE_CPU_ONLY=1 skips it. XLASERVE_SETUP_DRY_RUN=1
# prints what it would install and stops.
# Usage: scripts/setup.sh [EXTRA]   e.g. `scripts/setup.sh test`
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"

has_nvidia_gpu() {
  [ -z "${XLASERVE_CPU_ONLY:-}" ] && command -v nvidia-smi >/dev/null 2>&1 \
    && nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q .
}

if has_nvidia_gpu; then
  gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
  echo "setup: NVIDIA GPU found ($gpu): installing the cuda12 extra (jax[cuda12])"
  extra="${extra:+$extra,}cuda12"
else
  echo "setup: no NVIDIA GPU (nvidia-smi reports none): installing the CPU build of jaxlib"
fi

ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }

find_python() {
  local c
  for c in python3.12 python3 python3.13; do  # 3.12 first: the GPU machine runs it
    if command -v "$c" >/dev/null && ok "$(command -v "$c")"; then command -v "$c"; return; fi
  done
  local root="${PYENV_ROOT:-$HOME/.pyenv}"
  # 3.12 first (what the GPU machine runs), then the newest.
  for c in $(ls -d "$root"/versions/3.12.* 2>/dev/null; ls -d "$root"/versions/3.* 2>/dev/null | sort -V -r); do
    if [ -x "$c/bin/python3" ] && ok "$c/bin/python3"; then echo "$c/bin/python3"; return; fi
  done
  echo "no Python >= 3.12 found on PATH or in pyenv; install one" >&2
  exit 1
}

if [ -n "${XLASERVE_SETUP_DRY_RUN:-}" ]; then  # tests: what would be installed
  echo "setup: would install .[${extra}]"
  exit 0
fi

if [ ! -x .venv/bin/python ] || ! ok .venv/bin/python; then
  rm -rf .venv
  "$(find_python)" -m venv .venv
fi
stamp=".venv/.installed-${extra:-base}"
stamp="${stamp//,/-}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  if [ -n "$extra" ]; then .venv/bin/python -m pip install -q -e ".[$extra]"
  else .venv/bin/python -m pip install -q -e .; fi
  touch "$stamp"
fi
