"""Where a `--model` lives: a folder, or a Hugging Face model id (`org/name`) found offline in
the local Hugging Face cache, as `vllm serve org/name` finds it. Plain Python: nothing is
downloaded (the serving machine may have no network); a missing model is a clear error.

The cache's layout (huggingface_hub): $HF_HUB_CACHE, else $HF_HOME/hub, else
~/.cache/huggingface/hub, holding `models--{org}--{name}/snapshots/{revision}/` folders and
`refs/main` naming the revision to use.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

_MODEL_ID = re.compile(r"^[\w.\-]+/[\w.\-]+$")


class ModelNotFoundError(ValueError):
    pass


def hub_cache_dir(environ=os.environ) -> Path:
    if environ.get("HF_HUB_CACHE"):
        return Path(environ["HF_HUB_CACHE"])
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]) / "hub"
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface" / "hub"


def is_model_id(model: str) -> bool:
    return bool(_MODEL_ID.match(model)) and not model.startswith(".")


def resolve_model_source(model: str, revision: str = "main", environ=os.environ) -> Path:
    """A folder as it is; an `org/name` id that is not a folder -> its cached snapshot."""
    path = Path(model).expanduser()
    if path.exists() or not is_model_id(model):
        return path
    cache = hub_cache_dir(environ)
    repo = cache / ("models--" + model.replace("/", "--"))
    snapshot = _snapshot(repo, revision)
    if snapshot is None:
        raise ModelNotFoundError(
            f"model {model!r} is neither a folder nor in the Hugging Face cache ({repo} not "
            "found); xlaserve does not download models: fetch it first (for example "
            f"`huggingface-cli download {model}`, with HF_HOME set as here) or pass a folder")
    if not (snapshot / "config.json").is_file():
        raise ModelNotFoundError(f"the cached snapshot {snapshot} of {model!r} has no "
                                 "config.json; download the model again")
    return snapshot


def _snapshot(repo: Path, revision: str) -> Path | None:
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / revision
    if ref.is_file():
        named = snapshots / ref.read_text().strip()
        if named.is_dir():
            return named
    if (snapshots / revision).is_dir():  # a commit hash given as the revision
        return snapshots / revision
    found = sorted((p for p in snapshots.iterdir() if p.is_dir()),
                   key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None
