"""The installed package's version (`xlaserve --version`, /server_info). Plain Python."""
from __future__ import annotations


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version as dist_version
    try:
        return dist_version("xlaserve")
    except PackageNotFoundError:
        return "unknown (not installed)"
