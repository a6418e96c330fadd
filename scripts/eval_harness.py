"""lm-evaluation-harness through our server: its `local-completions` model against a running
xlaserve and its `hf` model on the same weights, on two small tasks of this project
(tests/data/eval_mc.jsonl: multiple choice, scored by loglikelihood; tests/data/eval_gen.jsonl:
generate_until). Prints both scores and the largest per-choice loglikelihood difference.

usage: python scripts/eval_harness.py [--model HF_DIR] [--base-url URL] [--limit N]

With no --base-url it starts `xlaserve serve` on the model (float32) and stops it after.
With no --model, the demo model (SmolLM2-135M-Instruct). lm-eval is not a dependency of
this project (it pulls in datasets, pandas, pyarrow, scikit-learn, nltk, ...); install it
first: pip install 'lm-eval[api]==0.4.13'. Exits 1 when the accuracies differ or a
loglikelihood differs by more than --tolerance.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from serve_check import wait_healthy  # noqa: E402
DATA = ROOT / "tests" / "data"
SERVED_NAME = "xlaserve-eval"

MC_TASK = """task: xlaserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/eval_mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""
GEN_TASK = """task: xlaserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/eval_gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 12
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
    regexes_to_ignore: ['^\\s+', '\\s+$']
"""
TASKS = ("xlaserve_mc", "xlaserve_gen")


def demo_hf_folder() -> Path:
    """The demo model as a Hugging Face folder (lm-eval's hf model loads that, not our
    checkpoint), where `xlaserve serve` keeps it."""
    from model.demo import fetch_demo_model
    from serving.core.config import default_cache_root
    return fetch_demo_model(default_cache_root() / "demo" / "SmolLM2-135M-Instruct-hf")


def write_tasks(folder: Path) -> Path:
    (folder / "xlaserve_mc.yaml").write_text(MC_TASK.format(data=DATA))
    (folder / "xlaserve_gen.yaml").write_text(GEN_TASK.format(data=DATA))
    return folder


def start_server(model_dir: str, port: int, server_args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "serving", "serve", "--model", model_dir, "--dtype", "float32",
           "--port", str(port), "--served-model-name", SERVED_NAME, *server_args]
    print("starting:", " ".join(cmd), flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    try:  # a cold warm-up compiles every program
        wait_healthy(port, proc, time.monotonic() + 1800)
    except (RuntimeError, TimeoutError) as e:
        proc.terminate()
        raise SystemExit(str(e)) from None
    return proc


def evaluate(model: str, model_args: str, task_dir: Path, limit: int | None) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager
    started = time.perf_counter()
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(TASKS),
                                  task_manager=TaskManager(include_path=str(task_dir)),
                                  limit=limit, log_samples=True, random_seed=0,
                                  numpy_random_seed=0, torch_random_seed=0)
    out["seconds"] = time.perf_counter() - started
    return out


def loglikelihoods(out: dict) -> dict[int, list[float]]:
    """doc id -> each choice's loglikelihood (multiple-choice task)."""
    return {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]]
            for s in out["samples"]["xlaserve_mc"]}


def generations(out: dict) -> dict[int, str]:
    return {s["doc_id"]: s["filtered_resps"][0] for s in out["samples"]["xlaserve_gen"]}


def scores(out: dict) -> dict[str, float]:
    r = out["results"]
    return {"acc": r["xlaserve_mc"]["acc,none"], "acc_norm": r["xlaserve_mc"]["acc_norm,none"],
            "exact_match": r["xlaserve_gen"]["exact_match,none"]}


def compare(served: dict, hf: dict) -> dict:
    a, b = loglikelihoods(served), loglikelihoods(hf)
    diffs = [abs(x - y) for d in a for x, y in zip(a[d], b[d], strict=True)]
    ga, gb = generations(served), generations(hf)
    return {"served": scores(served), "hf": scores(hf), "choices": len(diffs),
            "max_loglikelihood_diff": max(diffs),
            "same_generations": sum(ga[d] == gb[d] for d in ga), "generations": len(ga),
            "seconds": {"served": served["seconds"], "hf": hf["seconds"]}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="Hugging Face folder (default: the demo model)")
    ap.add_argument("--base-url", default=None,
                    help="a running server's /v1/completions URL serving --model in float32")
    ap.add_argument("--served-model-name", default=SERVED_NAME)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--server-args", default="--max-model-len 256 --max-num-seqs 8 "
                    "--max-num-batched-tokens 256 --token-buckets 16,256 --request-buckets 8 "
                    "--page-buckets 16",
                    help="extra `xlaserve serve` flags when this script starts the server")
    ap.add_argument("--limit", type=int, default=None, help="documents per task")
    ap.add_argument("--batch-size", type=int, default=8, help="prompts per request")
    ap.add_argument("--tolerance", type=float, default=1e-3)
    ap.add_argument("--json", default=None, help="also write the comparison here")
    args = ap.parse_args(argv)
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise SystemExit("lm-eval is not installed: pip install 'lm-eval[api]==0.4.13'")
    model_dir = args.model or str(demo_hf_folder())
    base_url = args.base_url or f"http://127.0.0.1:{args.port}/v1/completions"
    server = None if args.base_url else start_server(model_dir, args.port,
                                                      args.server_args.split())
    with tempfile.TemporaryDirectory() as tmp:
        task_dir = write_tasks(Path(tmp))
        try:
            served = evaluate("local-completions",
                              f"base_url={base_url},model={args.served_model_name},"
                              f"tokenizer_backend=remote,tokenized_requests=True,"
                              f"batch_size={args.batch_size},num_concurrent=1,max_retries=1,"
                              f"timeout=600", task_dir, args.limit)
        finally:
            if server is not None:
                server.terminate()
                server.wait(60)
        hf = evaluate("hf", f"pretrained={model_dir},dtype=float32,device=cpu,"
                            f"batch_size={args.batch_size}", task_dir, args.limit)
    result = compare(served, hf)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    ok = (result["served"]["acc"] == result["hf"]["acc"]
          and result["served"]["acc_norm"] == result["hf"]["acc_norm"]
          and result["max_loglikelihood_diff"] <= args.tolerance)
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
