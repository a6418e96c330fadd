"""The `xlaserve` command: `serve` (the OpenAI-compatible server) and `warmup` (compile every
bucket into the persistent compilation cache, then exit)."""
from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import sys
import threading
import time
import traceback

from model.config import ATTENTION_BACKENDS, DTYPES, KV_CACHE_DTYPES, MOE_BACKENDS
from serving.core.config import EngineConfig, default_cache_root
from serving.core.version import version
from serving.core.kv_events_config import KVEventsConfig
from serving.kv_transfer.config import KVTransferConfig
from serving.lora.request import LoRAModule
from serving.engine.memory_plan import DEFAULT_GPU_MEMORY_UTILIZATION

TOOL_PARSERS = ("hermes", "llama3_json")  # serving/openai/tool_parsers.py
from serving.openai.reasoning_parsers import PARSERS as REASONING_PARSERS  # noqa: E402 - plain Python


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="as --model (`xlaserve serve MODEL`, as `vllm serve MODEL`)")
    p.add_argument("--model", default=None,
                   help="checkpoint or Hugging Face folder, or a Hugging Face model id "
                        "(org/name) already in the local Hugging Face cache (HF_HOME); "
                        "nothing is downloaded (default: the demo model)")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                   help="weights and activations; auto: the config's torch_dtype, but "
                        "bfloat16 for a float32 model on a GPU (on a CPU: the checkpoint's)")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights from the folder's config.json (vLLM's name; "
                        "for benchmarks and GPU checks)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: on a GPU the model's whole context if the KV cache holds one "
                        "sequence of it, else as much as it holds; on a CPU at most 2048")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (default: 512)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--gpu-memory-utilization", type=float,
                   default=DEFAULT_GPU_MEMORY_UTILIZATION,
                   help="fraction of the GPU's total memory for weights, the largest step's "
                        "activations and the KV cache, which gets the rest (vLLM's meaning)")
    p.add_argument("--kv-cache-memory", type=_bytes, default=None, metavar="BYTES",
                   help="KV cache size in bytes (20GiB, 20GB or 20000000000) instead of what "
                        "--gpu-memory-utilization leaves; default off-GPU: enough for "
                        "--max-num-seqs full sequences, at most half the memory available")
    p.add_argument("--attention-backend", default="auto",
                   choices=["auto", *ATTENTION_BACKENDS],
                   help="auto: pallas on a GPU, the C++ kernel (cpu) or blocked elsewhere")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a folder whose tokenizer (and chat template) replaces the model's; "
                        "for a GGUF file, instead of the one rebuilt from its metadata")
    p.add_argument("--quantize", "--quantization", dest="quantize", default="auto",
                   metavar="auto|none|int8|int4|fp8",
                   help="quantize an unquantized model's weights as it loads: int8 (per "
                        "channel), int4 (groups of 32, GGUF's Q4_1), fp8 (per tensor, fp8 "
                        "GEMM) or a recipe such as fp8:channel, fp8:block (128 x 128 block "
                        "scales, DeepSeek-V3's) or int8:embed,lm_head; a "
                        "quantized checkpoint needs none. "
                        "auto (default): the checkpoint's weights, but int4:lm_head for the "
                        "demo model on a CPU; none: the checkpoint's")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV cache storage: auto (the model's dtype; float16 for the demo "
                        "model on a CPU), a float dtype, or int8 / fp8 with scales")
    p.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=("auto", *DTYPES),
                   help="a linear-attention hybrid's recurrent state (Qwen3-Next, Qwen3.5): "
                        "auto (config.json's mamba_ssm_dtype, else float32) or a float dtype")
    p.add_argument("--compilation-cache-dir", default=None,
                   help=f"compiled programs and weights quantized at load, kept for the "
                        f"next start (default: {default_cache_root() / 'jax-cache'}); '' "
                        f"keeps none")
    p.add_argument("--seed", type=int, default=0,
                   help="draws the seeds of requests that bring none")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="most top logprobs a request may ask per token (logprobs, "
                        "prompt_logprobs); each compiled step computes this many")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse the KV cache of prompt prefixes seen before "
                                      "(default: on)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=True, help="prepare and launch each step while the previous one "
                                      "still runs on the device (default: on)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding with vLLM\'s keys, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 3, '
                        '"prompt_lookup_min": 1}\' or \'{"method": "draft_model", "model": '
                        'DIR, "num_speculative_tokens": 3}\' (and "disable_by_batch_size": off '
                        'for a step with more running requests; default 4)')
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split the model over the first N devices (tensor parallel; N must "
                        "divide the query heads, start-up lists the sizes that work)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                   help="N replicas of the model (each over --tensor-parallel-size devices "
                        "of its own, with its own scheduler and KV cache) behind this one "
                        "server; --max-num-seqs is per replica; X-data-parallel-rank pins a "
                        "request to one")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="a mixture-of-experts model: split the experts whole over the "
                        "tensor-parallel devices (N must divide the experts) instead of "
                        "splitting each expert's matmuls")
    p.add_argument("--moe-backend", default="auto", choices=MOE_BACKENDS,
                   help="a mixture of experts' grouped matmuls: auto (our Pallas kernel on "
                        "NVIDIA GPUs, where XLA makes ragged_dot a dense dot over every "
                        "expert; the packed C++ kernels or ragged_dot elsewhere), ragged_dot, "
                        "or pallas")
    p.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="several processes, one model: process 0's address (jax.distributed; "
                        "the step channel uses PORT+1 too)")
    p.add_argument("--num-processes", type=int, default=1,
                   help="processes sharing the model (each runs this command)")
    p.add_argument("--process-id", type=int, default=0,
                   help="this process's rank; 0 serves HTTP and schedules, the others run "
                        "its steps")
    p.add_argument("--task", choices=["generate", "embed"], default="generate",
                   help="embed: serve the model as an embedding model (/v1/embeddings; the "
                        "generation routes answer 400)")
    p.add_argument("--runner", choices=["generate", "pooling"], default=None,
                   help="vLLM's newer name for the same choice: pooling is --task embed")
    p.add_argument("--pooler-config", default=None, metavar="JSON",
                   help='with --task embed, vLLM\'s keys: \'{"pooling_type": "MEAN", '
                        '"normalize": true}\' (LAST, MEAN or CLS; default: the model '
                        "folder's sentence-transformers files, else LAST with normalize)")
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help='publish KV cache events for KV-aware routers, vLLM\'s keys: '
                        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
                        '"replay_endpoint": "tcp://*:5558", "topic": "kv@HOST@MODEL"}\' '
                        '(and "event_encoding": "array" for consumers of vLLM <= 0.23; '
                        'default: off)')
    p.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help='prefill/decode disaggregation, vLLM\'s keys: \'{"kv_connector": '
                        '"JaxTransferConnector", "kv_role": "kv_producer", "kv_port": 14579}\' '
                        "(kv_role kv_producer, kv_consumer or kv_both; kv_connector_extra_config "
                        "offer_timeout_s, pull_timeout_s, side_channel_port, advertise_host; "
                        "default: off)")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT folders) over the model")
    p.add_argument("--max-loras", type=int, default=1,
                   help="LoRA adapters in one step (device slots)")
    p.add_argument("--max-lora-rank", type=int, default=16,
                   help="largest adapter rank: 1, 8, 16, 32, 64, 128, 256, 320 or 512")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="parsed adapters kept on the host (default: --max-loras)")
    for name, what in (("token", "tokens per step"), ("request", "requests per step"),
                       ("page", "pages per request")):
        p.add_argument(f"--{name}-buckets", type=_int_list, default=None, metavar="N,N,...",
                       help=f"compiled {what} (default: powers of two up to the maximum; "
                            "for pages with the cpu and pallas backends, the maximum alone)")


def _bytes(text: str) -> int:
    from serving.engine.memory_plan import parse_bytes
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


class _DefaultsFormatter(argparse.HelpFormatter):
    """Shows each option's default, unless its help already says it or there is none."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text or action.default in (None, argparse.SUPPRESS)
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)".strip()


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _model(args) -> str | None:
    if args.model_tag and args.model and args.model_tag != args.model:
        raise SystemExit(f"error: two models given: {args.model_tag!r} and --model "
                         f"{args.model!r}")
    return args.model_tag or args.model


def _served_name(args) -> str:
    return getattr(args, "served_model_name", None) or (_model(args) or "SmolLM2-135M-Instruct")


def _engine_config(args) -> EngineConfig:
    kwargs = dict(model=_model(args), tokenizer=args.tokenizer, dtype=args.dtype,
                  load_format=args.load_format,
                  gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
                  max_model_len=args.max_model_len,
                  max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size,
                  kv_cache_memory=args.kv_cache_memory, attention_backend=args.attention_backend,
                  quantize=args.quantize, kv_cache_dtype=args.kv_cache_dtype,
                  mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype, seed=args.seed, max_logprobs=args.max_logprobs,
                  enable_prefix_caching=args.enable_prefix_caching,
                  async_scheduling=args.async_scheduling,
                  speculative_config=args.speculative_config,
                  tensor_parallel_size=args.tensor_parallel_size,
                  data_parallel_size=args.data_parallel_size,
                  enable_expert_parallel=args.enable_expert_parallel,
                  moe_backend=args.moe_backend,
                  coordinator_address=args.coordinator_address,
                  num_processes=args.num_processes, process_id=args.process_id,
                  task=args.task, runner=args.runner, pooler_config=args.pooler_config,
                  kv_events_config=args.kv_events_config,
                  kv_transfer_config=args.kv_transfer_config,
                  enable_lora=args.enable_lora, max_loras=args.max_loras,
                  max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
                  token_buckets=args.token_buckets,
                  request_buckets=args.request_buckets, page_buckets=args.page_buckets)
    if args.compilation_cache_dir is not None:  # "" turns the cache off
        kwargs["compilation_cache_dir"] = args.compilation_cache_dir
    KVEventsConfig.parse(args.kv_events_config)  # a bad config fails before the model loads
    KVTransferConfig.parse(args.kv_transfer_config)
    return EngineConfig(**kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xlaserve")
    parser.add_argument("--version", action="version", version=f"xlaserve {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    defaults = _DefaultsFormatter
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API",
                           formatter_class=defaults)
    _engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--served-model-name", default=None,
                       help="the model's name in the API (default: MODEL as given)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but /health")
    serve.add_argument("--max-queued-requests", type=int, default=None,
                       help="answer 503 while this many requests wait for a slot")
    serve.add_argument("--disable-access-log", action="store_true",
                       help="no access log line per request (method, path, status, tokens, "
                            "latency)")
    serve.add_argument("--grace-period", type=float, default=30.0,
                       help="seconds in-flight requests may take to finish on SIGTERM")
    serve.add_argument("--disable-log-stats", action="store_true",
                       help="no periodic stats line (throughput, KV cache, prefix cache hits)")
    serve.add_argument("--chat-template", default=None, metavar="FILE",
                       help="a Jinja chat template (a file, or the template itself) instead "
                            "of the tokenizer's (default for the demo model: "
                            "serving/openai/chat_templates/chatml_tools.jinja)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="tool_choice \"auto\" (the default when tools are sent): parse "
                            "the model's tool calls with --tool-call-parser (on for the demo)")
    serve.add_argument("--tool-call-parser", default=None, choices=TOOL_PARSERS,
                       help="how the model writes tool calls (the demo: hermes)")
    serve.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                       help="return the model's <think>...</think> apart from the answer "
                            "(message.reasoning_content); constraints apply to the answer")
    serve.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters served by name (with --enable-lora): name=path, "
                            "or JSON {\"name\", \"path\", \"base_model_name\"}")
    serve.add_argument("--disable-responses-store", action="store_true",
                       help="the Responses API stores nothing: previous_response_id and GET "
                            "/v1/responses/{id} find nothing, an explicit store: true is a 400")
    warm = sub.add_parser("warmup", help="compile every bucket into the compilation cache",
                          formatter_class=defaults)
    _engine_args(warm)
    return parser


# Libraries that log pages of INFO while a checkpoint loads (orbax logs through absl) or
# while JAX looks for backends; their warnings still show.
_NOISY_LOGGERS = ("absl", "orbax", "jax", "etils")


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def main(argv=None) -> int:
    started = time.perf_counter()  # "ready in" counts importing JAX and loading the model
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("serve", "warmup", "-h", "--help", "--version"):
        argv.insert(0, "serve")  # `python -m serving --model DIR` serves
    args = build_parser().parse_args(argv)
    _setup_logging()
    if args.command in ("serve", "warmup"):
        # The CPU kernels' first build (~16 s) runs beside importing JAX and reading weights.
        from pallas_kernels.cpu_build import start_building
        start_building()
    # Before JAX starts its backend: XLA's allocator reads its limit once.
    from serving.engine.memory_plan import configure_xla_allocator_if_unstarted
    configure_xla_allocator_if_unstarted(args.gpu_memory_utilization)
    from serving.engine.llm_engine import LLMEngine
    try:
        chat = _chat_options(args) if args.command == "serve" else None
        modules = [LoRAModule.parse(m) for m in getattr(args, "lora_modules", None) or []]
        if modules and not args.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        for m in modules:
            if m.name == _served_name(args):
                raise ValueError(f"--lora-modules: the adapter name {m.name!r} is the served "
                                 "model's name")
        replicas = None
        if args.data_parallel_size != 1:
            from serving.engine.data_parallel import build_replicas
            replicas = build_replicas(_engine_config(args), None if getattr(
                args, "disable_log_stats", True) else 10.0)
            engine = replicas.engine
        else:
            engine = LLMEngine(_engine_config(args))
        for m in modules:
            engine.lora.register(m.name, m.path, m.base_model_name)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"xlaserve: {engine.describe()}"
          + (f"; {args.data_parallel_size} data-parallel replicas" if replicas else ""),
          flush=True)
    if engine.cluster is not None and not engine.cluster.is_leader:
        engine.warmup()
        print(f"xlaserve: process {args.process_id} ready, running process 0's steps",
              flush=True)
        return engine.cluster.serve(engine.runner)
    if args.command == "warmup":
        if replicas is not None:
            replicas.start()
            replicas.shutdown()
            replicas.close()
        else:
            engine.warmup()
            engine.close()
        if engine.cluster is not None:
            engine.cluster.stop()  # the followers exit 0 too
        print(f"xlaserve: {warmup_summary(engine)}; {time.perf_counter() - started:.1f} s in "
              "all", flush=True)
        return 0
    return asyncio.run(_serve(engine, args, chat, started, replicas))


async def _serve(engine, args, chat: tuple[str | None, str | None], started: float,
                 replicas=None) -> int:
    """replicas: a DataParallelEngine (-dp > 1), served instead of one AsyncEngine over
    engine (then its first replica's)."""
    from serving.engine.async_engine import AsyncEngine
    async_engine = replicas or AsyncEngine(engine, None if args.disable_log_stats else 10.0)
    if engine.cluster is not None:  # a follower gone: fail what is in flight, then exit 1
        engine.cluster.on_lost.append(async_engine.fail_everything)
    # /health answers 503 while the programs compile; warm-up runs off the event loop, and
    # starts first: the server's imports run while its programs load.
    warm = _start_in_background(async_engine)
    from serving.openai.api_server import run_server
    name = _served_name(args)
    chat_template, tool_call_parser = chat
    server = asyncio.create_task(run_server(
        async_engine, args.host, args.port, served_model_name=name, api_key=args.api_key,
        max_queued_requests=args.max_queued_requests, grace_period_s=args.grace_period,
        chat_template=chat_template, tool_call_parser=tool_call_parser,
        access_log=not args.disable_access_log, reasoning_parser=args.reasoning_parser,
        disable_responses_store=args.disable_responses_store))
    try:
        await asyncio.wait({server, warm}, return_when=asyncio.FIRST_COMPLETED)
        if not warm.done():  # SIGTERM during warm-up, or the server could not start
            _exit_during_warmup(server)
        warm.result()
        # Everything loaded so far lives until exit: keep it out of the collector's way
        # (full collections over JAX, transformers and friends stall the event loop for
        # seconds, and the last one delays exit), as vLLM does.
        gc.collect()
        gc.freeze()
        print(f"xlaserve: {warmup_summary(engine)}", flush=True)
        url = f" on http://{args.host}:{args.port}" if args.port else ""
        print(f"xlaserve: ready{url} in {time.perf_counter() - started:.1f} s", flush=True)
        return await server  # 1 when the engine died
    finally:
        if not server.done():  # warm-up failed: stop listening before the error shows
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)
        async_engine.shutdown()
        # after the engine threads: no step publishes while it closes
        (replicas or engine).close()
        if engine.cluster is not None:
            engine.cluster.stop()


def warmup_summary(engine) -> str:
    """'N programs (L loaded, C compiled); weights 1.2 s, compile/load 3.4 s, first step
    0.1 s; compiled programs in DIR'."""
    r = engine.warmup_report
    phases = ", ".join(f"{k} {v:.1f} s" for k, v in engine.timings.items())
    where = engine.executable_dir or "no folder (not saved)"
    return (f"{r.programs} programs ({r.loaded} loaded, {r.compiled} compiled); "
            f"{phases}; compiled programs in {where}")


def _chat_options(args) -> tuple[str | None, str | None]:
    """(chat template text or None for the tokenizer's, the tool-call parser for tool_choice
    "auto" or None). The demo model gets a template with tools and the hermes parser."""
    from serving.openai.tools import DEMO_CHAT_TEMPLATE, read_chat_template
    template, parser = args.chat_template, args.tool_call_parser
    auto = args.enable_auto_tool_choice
    if _model(args) is None:
        template = template or str(DEMO_CHAT_TEMPLATE)
        if not auto and parser is None:
            auto, parser = True, "hermes"
    if auto != (parser is not None):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together")
    return (read_chat_template(template) if template else None), parser


def _exit_during_warmup(server: asyncio.Task) -> None:
    """The compiler cannot be interrupted, and interpreter shutdown while a thread is still
    inside XLA aborts the process: report, then leave without waiting for it."""
    code = 0
    try:
        server.result()
        print("xlaserve: stopped before warm-up finished", flush=True)
    except OSError as e:  # e.g. the port is taken
        print(f"error: {e}", file=sys.stderr)
        code = 1
    except BaseException:  # noqa: BLE001 - anything else: show it, then leave
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _start_in_background(async_engine) -> asyncio.Future:
    """Warm-up in a daemon thread (not asyncio.to_thread): a SIGTERM during warm-up must not
    wait for the compiler to finish before the process can exit."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def resolve(error: BaseException | None) -> None:
        if not done.done():
            done.set_exception(error) if error is not None else done.set_result(None)

    def target() -> None:
        error = None
        try:
            async_engine.start()
        except BaseException as e:  # noqa: BLE001 - re-raised on the event loop
            error = e
        try:
            loop.call_soon_threadsafe(resolve, error)
        except RuntimeError:
            pass  # the loop is gone: the server stopped during warm-up

    threading.Thread(target=target, name="xlaserve-warmup", daemon=True).start()
    return done


if __name__ == "__main__":
    sys.exit(main())
