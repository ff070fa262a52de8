"""`xllm-gen-serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine.

    xllm-gen-serve [MODEL] [--host 127.0.0.1 --port 8000 --tensor-parallel-size 1 --max-model-len N
                   --max-num-seqs 256 --max-queue 256 ...]

Without MODEL it serves the embedded default (xllm_gen/default_model.py: a tiny random-weight checkpoint built offline on first use).
Endpoints: POST /v1/completions, POST /v1/chat/completions (stream: true gives Server-Sent Events in
OpenAI's chunk format ending with `data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus)."""
from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Optional

from xllm_gen.runtime.serving.app import build_app

logger = logging.getLogger("xllm_gen.serving")

DTYPES = ("bf16", "bfloat16", "float", "float16", "float32", "fp16", "fp32", "half")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="xllm-gen-serve", description="An OpenAI-compatible server (completions, "
                                 "chat, streaming, metrics) over a Hugging Face checkpoint dir.")
    ap.add_argument("model", nargs="?", help="HF checkpoint dir (default: the embedded tiny checkpoint, built on first use)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    ap.add_argument("--port", type=int, default=8000, help="TCP port (0: pick a free one, printed at start)")
    ap.add_argument("--served-model-name", help="model name in the API (default: the checkpoint dir name)")
    ap.add_argument("--tokenizer", help="tokenizer dir (default: the checkpoint dir)")
    ap.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, help="tensor-parallel ranks")
    ap.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one batch")
    ap.add_argument("--max-queue", type=int, default=256,
                    help="most requests waiting beyond the batch; more are refused with HTTP 503")
    ap.add_argument("--max-num-batched-tokens", type=int, help="tokens per prefill step")
    ap.add_argument("--enable-chunked-prefill", action="store_true", help="prefill long prompts in chunks")
    ap.add_argument("--device", default="auto", help="auto, cuda or cpu")
    ap.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="weights and KV dtype")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    ap.add_argument("--num-kv-blocks", type=int, help="KV blocks (default: from --gpu-memory-utilization)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="fraction of GPU memory to use")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--cuda-graph-sizes", type=int, nargs="*",
                    help="decode CUDA-graph batch sizes (default: 1 2 4 8, then multiples of 16 up to --max-num-seqs)")
    ap.add_argument("--prefill-graph-sizes", type=int, nargs="*",
                    help="token counts of the piecewise prefill CUDA graphs (default: 16 ... 4096; none: eager prefill)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                    help="dummy: random weights of the config's shapes, no checkpoint read (benchmarks)")
    ap.add_argument("--quantization", default=None, choices=["fp8"],
                    help="fp8: quantize an unquantized checkpoint's linear weights to fp8 per channel at load "
                         "(a quantized checkpoint's own quantization_config needs no flag)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                    help="fp8: the KV cache in float8 e4m3 (with the checkpoint's k_scale / "
                         "v_scale, per tensor or per KV head, where it has them, else scale 1.0)")
    ap.add_argument("--mm-preprocess-device", default="cpu",
                    help="where image / video preprocessing runs: cpu (the host; the default until the device "
                         "path has run on a GPU), auto (the model's GPU when the processor supports it), or a "
                         "device such as cuda:0")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                    help="reuse the KV of shared prompt prefixes (on by default)")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                    help="launch each greedy decode step before the previous one's tokens are read back, so that "
                         "the host's work overlaps the GPU's (on by default)")
    ap.add_argument("--speculative-config", metavar="JSON",
                    help='speculative decoding, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 3, '
                         '"prompt_lookup_max": 3}\' or \'{"method": "draft_model", "model": DIR, '
                         '"num_speculative_tokens": 4}\' (runtime/engine/spec_decode.py)')
    ap.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    ap.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                    help="sampling defaults for what a request leaves unset (temperature, top_p, top_k, min_p, "
                         "repetition_penalty; max_new_tokens for an absent max_tokens): auto, the checkpoint's "
                         "generation_config.json (as vLLM); vllm, none; or a directory holding one")
    ap.add_argument("--chat-template", help="chat template (a Jinja file, or the template text) used instead of the "
                    "checkpoint's (a request's chat_template still wins)")
    ap.add_argument("--tool-call-parser", help="how tool calls are read from the output (hermes: <tool_call> JSON "
                    "</tool_call>); enables tools with tool_choice auto, required and named")
    ap.add_argument("--reasoning-parser", help="split the reasoning from the answer into reasoning_content "
                    "(think: a reply opening with <think> ... </think>; model-family names are aliases, see README)")
    ap.add_argument("--engine-in-process", action="store_true",
                    help="run the engine (scheduler, model, sampling) in a thread of the API process instead of its "
                         "own engine-core process (talking over ZeroMQ, the default)")
    ap.add_argument("--api-server-count", type=int, default=1, metavar="N",
                    help="API processes (HTTP, tokenization, detokenization) sharing the port and one engine core; "
                         "each has its own /metrics counters (the gauges are the core's)")
    ap.add_argument("--_api-server", help=argparse.SUPPRESS)     # INDEX,IN,OUT,FD,CORE_PID: API process i > 0
    ap.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="seconds in-flight requests may take to finish after SIGTERM before they are aborted")
    ap.add_argument("--allowed-local-media-path", metavar="DIR",
                    help="image / video parts may name local files (paths or file:// URLs) under DIR only "
                         "(default: local files are refused)")
    ap.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (default: $XLLM_API_KEY; none)")
    ap.add_argument("--allowed-origins", nargs="*", metavar="ORIGIN",
                    help="CORS: origins allowed to call the API from a browser ('*': any)")
    ap.add_argument("--disable-log-requests", action="store_true", help="no access log line per request")
    ap.add_argument("--log-stats-interval", type=float, default=10.0,
                    help="seconds between stats lines (running, waiting, KV usage, tokens/s) while busy; 0: none")
    ap.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                    help="log level")
    ap.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    return ap


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("xllm-gen")
    except Exception:
        return "unknown"


def _chat_template(arg: Optional[str]) -> Optional[str]:
    """--chat-template: a file's text, or the argument itself when it is a template (contains '{')."""
    if not arg:
        return None
    if "{" in arg:
        return arg
    from pathlib import Path
    path = Path(arg)
    if not path.is_file():
        raise ValueError(f"--chat-template: no such file: {arg}")
    return path.read_text()


def _check_chat_template(args, template: Optional[str]) -> None:
    """Before the load (fast): --chat-template, else the checkpoint's template, must compile: every chat request
    would fail on it, so the server does not start (ValueError naming the file and the line). A GGUF file's
    template is known only once converted: the engine logs it at load."""
    from pathlib import Path

    from xllm_gen.runtime.engine.chat_template import checkpoint_template_problem, template_problem

    if template is not None:
        problem = template_problem(template)
        if problem:
            raise ValueError(f"--chat-template does not compile: {problem}")
        return
    where = args.tokenizer or args.model
    problem = checkpoint_template_problem(Path(where)) if where and Path(where).is_dir() else None
    if problem:
        raise ValueError(f"the checkpoint's chat template does not compile: {problem}; fix it, or serve with "
                         "--chat-template FILE (a template to use instead)")


def check_model_path(model: str) -> None:
    """A clear error for a model argument that is not a checkpoint dir (before any heavy import)."""
    from pathlib import Path

    p = Path(model)
    if p.is_dir():
        return
    if p.exists():
        raise ValueError(f"model {model!r} is a file; give the checkpoint directory (with config.json)")
    parts = model.split("/")
    if len(parts) == 2 and all(parts) and not model.startswith((".", "~")):
        raise ValueError(f"model {model!r} does not exist locally; it looks like a Hugging Face hub id, but "
                         "downloads are not supported: download it first (e.g. `huggingface-cli download "
                         f"{model} --local-dir DIR`) and pass DIR")
    raise ValueError(f"model path {model!r} does not exist")


def bind_socket(host: str, port: int):
    """The listening socket, bound before the model loads, so that a busy port fails at once."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e} (is another server running there? "
                         "pick another --port, or 0 for a free one)") from None
    return sock                        # not inheritable: tensor-parallel rank processes never hold it


def make_engine(args):
    import inspect

    from xllm_gen.runtime.engine.engine import LLMEngine

    model = args.model
    if not model:
        from xllm_gen.runtime.cli import default_checkpoint
        model = str(default_checkpoint())
    else:
        check_model_path(model)
    kw = dict(device=args.device, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
              block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
              seed=args.seed, enable_chunked_prefill=args.enable_chunked_prefill or None, tokenizer=args.tokenizer,
              load_format=args.load_format, cuda_graph_sizes=args.cuda_graph_sizes,
              prefill_graph_sizes=args.prefill_graph_sizes, async_scheduling=args.async_scheduling,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
              generation_config=args.generation_config)
    if args.mm_preprocess_device != "cpu":
        kw["mm_preprocess_device"] = args.mm_preprocess_device
    if getattr(args, "speculative_config", None):
        from xllm_gen.runtime.engine.spec_decode import SpeculativeConfig
        kw["speculative_config"] = SpeculativeConfig.parse(args.speculative_config)   # errors name the flag's key
    if args.enable_prefix_caching is not None:
        if "enable_prefix_caching" not in inspect.signature(LLMEngine.__init__).parameters:
            raise ValueError("--enable-prefix-caching: this engine has no prefix cache")
        kw["enable_prefix_caching"] = args.enable_prefix_caching
    return LLMEngine(model, **kw)


def _start_api_servers(argv: list, aeng, sock) -> list:
    """API processes 1..N-1 (--api-server-count N): the same arguments, the listening socket inherited, each
    with its own output address of the core that this process started, and the core's pid to watch."""
    import subprocess

    in_addr, outs = aeng.addresses
    fd = sock.fileno()
    os_set_inheritable(fd)
    return [subprocess.Popen([sys.executable, "-m", "xllm_gen.runtime.serving.server", *argv, "--_api-server",
                              f"{i},{in_addr},{outs[i]},{fd},{aeng.core_pid}"], pass_fds=(fd,))
            for i in range(1, len(outs))]


def os_set_inheritable(fd: int) -> None:
    import os
    os.set_inheritable(fd, True)


def main(argv=None) -> int:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    child = args._api_server
    several = args.api_server_count > 1 or child
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s"
                        f"{'[%(process)d]' if several else ''}: %(message)s")
    import os

    import uvicorn

    from xllm_gen.runtime.serving.async_engine import AsyncEngine
    from xllm_gen.runtime.serving.metrics import ServerMetrics

    api_key = args.api_key or os.environ.get("XLLM_API_KEY") or None
    try:
        if args.model:
            check_model_path(args.model)
        if args.allowed_local_media_path and not os.path.isdir(args.allowed_local_media_path):
            raise ValueError(f"--allowed-local-media-path: no such directory: {args.allowed_local_media_path}")
        if args.api_server_count < 1 or (args.api_server_count > 1 and args.engine_in_process):
            raise ValueError("--api-server-count must be >= 1, and 1 with --engine-in-process (several API "
                             "processes share one engine-core process)")
        if not args.engine_in_process:
            try:
                import zmq  # noqa: F401
            except ImportError:
                raise ValueError("the engine-core process talks over ZeroMQ, and pyzmq is not installed: "
                                 "pip install pyzmq, or serve with --engine-in-process") from None
        if child:                      # an API process i > 0: the first one's socket, its core
            import socket

            from xllm_gen.runtime.serving.engine_core import die_with_parent
            die_with_parent(os.getppid())
            index, in_addr, out_addr, fd, core_pid = child.split(",")
            sock = socket.socket(fileno=int(fd))
        else:
            sock = bind_socket(args.host, args.port)
        template = _chat_template(args.chat_template)
        _check_chat_template(args, template)
        from xllm_gen.runtime.serving import reasoning_parsers, tool_parsers
        if args.tool_call_parser:
            tool_parsers.get(args.tool_call_parser)
        if args.reasoning_parser:
            reasoning_parsers.get(args.reasoning_parser)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t_load = time.monotonic()
    from xllm_gen.runtime.serving.engine_core import engine_info

    try:
        if args.engine_in_process:
            engine = make_engine(args)
            aeng = AsyncEngine(engine, None, max_queue=args.max_queue, stats_interval=args.log_stats_interval)
            info = engine_info(engine)
        else:                          # the engine core in its own process (runtime/serving/engine_core.py)
            from xllm_gen.runtime.serving.core_client import CoreClient
            if child:
                aeng = CoreClient(args, None, max_queue=args.max_queue, stats_interval=0, index=int(index),
                                  addresses=(in_addr, [out_addr]), core_pid=int(core_pid))
            else:
                aeng = CoreClient(args, None, max_queue=args.max_queue, stats_interval=args.log_stats_interval,
                                  count=args.api_server_count)
                aeng.children = _start_api_servers(raw_argv, aeng, sock) if args.api_server_count > 1 else []
            engine = aeng.wait_ready()
            info = aeng.info
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or engine.model_dir.name
    metrics = aeng.metrics = ServerMetrics(name)
    app = build_app(aeng, name, metrics, tool_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                    chat_template=template, allowed_local_media_path=args.allowed_local_media_path,
                    api_key=api_key, allowed_origins=args.allowed_origins,
                    log_requests=not args.disable_log_requests)
    config = uvicorn.Config(app, host=args.host, port=sock.getsockname()[1], log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, access_log=False)
    server = uvicorn.Server(config)
    kv_bytes = info["kv_bytes"]
    if child:
        logger.info("API server %s of %d serving on the shared socket", index, args.api_server_count)
    else:
        logger.info("serving %s as %r on http://%s:%d: device %s, tensor parallel %d, dtype %s, loaded in %.1f s, "
                    "%d KV blocks of %d tokens (%s), max_model_len %d, max_num_seqs %d, engine %s%s",
                    engine.model_dir, name, args.host, sock.getsockname()[1], info["device"],
                    args.tensor_parallel_size, info["dtype"], time.monotonic() - t_load, info["num_blocks"],
                    info["block_size"], f"{kv_bytes} bytes" if kv_bytes is not None else "size unknown",
                    info["max_model_len"], info["max_num_seqs"],
                    "in process" if args.engine_in_process else f"core process pid {info['pid']}",
                    f", {args.api_server_count} API processes" if args.api_server_count > 1 else "")
    # uvicorn shuts down gracefully on SIGTERM / SIGINT, then re-raises the signal with the handlers found at
    # start: these make that a clean exit (0 for SIGTERM, 130 for Ctrl-C) instead of a kill or a traceback.
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))
    try:
        server.run(sockets=[sock])
    finally:
        if aeng._thread is None:            # the app never started: still stop the ranks (or the core)
            aeng.stop() if not args.engine_in_process else engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
