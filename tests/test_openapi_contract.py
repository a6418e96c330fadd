"""/openapi.json as a contract, checked by a generic OpenAPI fuzzer (schemathesis) against
the real server: requests it generates from the description, valid and invalid, get no 5xx,
and every response (status, content type, body, SSE events) is one the description lists."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_schema_conformance")


def test_schemathesis_over_openapi_json(shared_server, tmp_path):
    url = f"http://127.0.0.1:{shared_server.port}/openapi.json"
    cmd = [str(Path(sys.executable).parent / "schemathesis"), "run", url, "--checks", CHECKS,
           "--phases", "fuzzing", "--max-examples", "12", "--seed", "7", "--workers", "2",
           "--request-timeout", "120", "--generation-database", "none", "--no-color"]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(ROOT / "tests" / "schemathesis_hooks.py")}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    summary = proc.stdout[proc.stdout.find("SUMMARY"):]
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in summary and "failed" not in summary, summary
    shared_server.wait_idle()  # and every request it sent gave its pages back
