"""The app: routes, middleware and the `conveyor serve` entry point.

    conveyor serve MODEL [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine knobs]
    python -m conveyor.serve MODEL ...

Endpoints: POST /v1/completions, POST /v1/chat/completions (plain or streamed as
server-sent events ending with ``data: [DONE]``), GET /v1/models, GET /health,
GET /metrics (Prometheus text format), GET /v1/engine/settings and GET
/v1/engine/events (the engine's steps as server-sent events: events.py); the chat
page at / and the live view of batching at /batching unless --no-ui (ui.py).

The app is plain Starlette (no request-model magic), so every error is ours: bad
input gets 400 naming the field, never 422 or 500. A client that goes away has its
request aborted at once: a task per response waits for the ASGI ``http.disconnect``
message and cancels the generation, and cancelling AsyncLLM.generate's iterator
aborts the engine request and frees its KV blocks.

`build_app(engine, model_name=...)` returns the ASGI app for tests and embedding.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Optional

from .protocol import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUED_REQUESTS, APIError, bad_request
from .serving import Server, error_response, json_response


SWITCH_INTERVAL_S = 0.001  # the server process's GIL switch interval (see main)
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0  # what a stop signal leaves running requests (--shutdown-timeout)
SHUTDOWN_MARGIN_S = 1.0  # past it, the time the requests' ends take to go out before uvicorn cancels them


def load_chat_template(value: str) -> str:
    """--chat-template: a file's path, or the template itself."""
    from ..chat_template import check_chat_template

    if "{" not in value and os.path.isfile(value):
        with open(value, encoding="utf-8") as fh:
            value = fh.read()
    elif "{" not in value:
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    try:  # an operator's mistake, said at start, not a 400 blaming each client's messages
        check_chat_template(value)
    except ValueError as e:
        raise ValueError(f"--chat-template {e}".replace("the model's chat template ", "")) from None
    return value


def build_app(engine, *, model_name: str, api_key: Optional[str] = None, request_timeout: Optional[float] = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, chat_template: Optional[str] = None,
              allowed_origins: Optional[list] = None, tool_call_parser: Optional[str] = None,
              ui: bool = True, lora_modules: Optional[dict] = None):
    """The ASGI app serving `engine` (an AsyncLLM) under the name `model_name` (a str, or a
    list of names: requests may name any of them, answers carry the first).

    api_key: when set, /v1/* needs "Authorization: Bearer <api_key>".
    request_timeout: the deadline (seconds) of a request that names no "timeout".
    max_body_bytes: larger bodies get 413.
    tool_call_parser: how tool_choice "auto" answers are read (hermes, llama3_json, mistral,
    pythonic; default: chosen from the chat template's markers).
    ui: serve the chat page at / and the live view of batching at /batching.
    lora_modules: {name: adapter path} served over the base (engine made with enable_lora);
    a request's "model" selects one; /v1/load_lora_adapter and /v1/unload_lora_adapter
    change them at run time.
    Overload control is the engine's: an AsyncLLM made with max_queued_requests refuses the
    excess, answered 503 with Retry-After.
    """
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    names = [model_name] if isinstance(model_name, str) else model_name
    if not isinstance(names, (list, tuple)) or not names or \
            not all(isinstance(n, str) and n for n in names):
        raise ValueError("--served-model-name (model_name) must be a non-empty string or a non-empty list of them")
    if chat_template is not None:
        if engine.tokenizer is None:
            raise ValueError("a chat template needs a tokenizer")
        engine.tokenizer.chat_template = load_chat_template(chat_template)
    if request_timeout is not None and not (isinstance(request_timeout, (int, float)) and
                                            not isinstance(request_timeout, bool) and 0 < request_timeout <= 1e9):
        raise ValueError(f"request_timeout must be a number of seconds in (0, 1e9], got {request_timeout!r}")
    from .tool_parsers import detect_parser, get_parser

    parser = get_parser(tool_call_parser) if tool_call_parser is not None else None
    server = Server(engine, list(dict.fromkeys(names)), api_key, request_timeout, max_body_bytes)
    for lname, lpath in (lora_modules or {}).items():
        server.add_lora(lname, lpath)
    if engine.tokenizer is not None:
        server.validator.tool_parser = parser or detect_parser(getattr(engine.tokenizer, "chat_template", None))

    def guarded(fn):
        async def endpoint(request):
            try:
                return await fn(request)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - never a bare 500 page
                from .. import EngineClosedError

                if isinstance(e, APIError):
                    err = e
                elif isinstance(e, EngineClosedError):
                    err = server.closed_error()
                else:
                    # the details go to the log, not to the client
                    logging.getLogger("conveyor.serve").exception("internal error")
                    err = APIError(500, f"internal error ({type(e).__name__}); see the server log",
                                   type_="server_error")
                if err.status >= 400 and err.status != 499:  # 499: the client left (counted as a disconnect)
                    server.metrics.http_errors[err.status] = server.metrics.http_errors.get(err.status, 0) + 1
                return error_response(err)
        return endpoint

    async def completions(request):
        return await server.handle_generate(request, "completion")

    async def chat_completions(request):
        return await server.handle_generate(request, "chat")

    async def tokenize(request):
        server.check_auth(request)
        body = await server.read_json(request)
        ids = await server.off_loop(server.validator.tokenize, body)
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": server.max_model_len})

    async def detokenize(request):
        server.check_auth(request)
        body = await server.read_json(request)
        return json_response({"prompt": await server.off_loop(server.validator.detokenize, body)})

    def model_card(name: str):
        lora = server.loras.get(name)
        return {"id": name, "object": "model", "created": server.created, "owned_by": "conveyor",
                "root": lora.lora_path if lora else server.model_name,
                "parent": server.model_name if lora else None, "max_model_len": server.max_model_len,
                "vocab_size": server.vocab_size}

    async def models(request):
        server.check_auth(request)
        return json_response({"object": "list",
                              "data": [model_card(n) for n in server.model_names + list(server.loras)]})

    def lora_field(body, key: str) -> str:
        v = body.get(key) if isinstance(body, dict) else None
        if not isinstance(v, str) or not v:
            raise bad_request(key, f"'{key}' must be a non-empty string")
        return v

    async def load_lora(request):
        server.check_auth(request)
        body = await server.read_json(request)
        name, path = lora_field(body, "lora_name"), lora_field(body, "lora_path")
        try:
            await server.off_loop(server.add_lora, name, path)
        except FileNotFoundError as e:
            raise bad_request("lora_path", str(e)) from None
        except (ValueError, TypeError) as e:  # LoRAError: .field names the adapter's key
            field = getattr(e, "field", None)
            raise bad_request("lora_path" if field is None else f"lora_path: {field}", str(e)) from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(request):
        server.check_auth(request)
        body = await server.read_json(request)
        name = lora_field(body, "lora_name")
        server.remove_lora(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def model_one(request):
        server.check_auth(request)
        name = request.path_params["model"]
        server.check_model(name)
        return json_response(model_card(name))

    async def health(request):
        if engine.closed:
            return json_response({"status": "closed"}, 503)
        return json_response({"status": "ok"})

    async def metrics(request):
        try:
            stats = engine.stats()
        except Exception:  # noqa: BLE001 - a closed engine still answers /metrics
            stats = {}
        text = server.metrics.render(stats, server.in_flight)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def http_error(request, exc):
        msg = {404: f"no route for {request.url.path}", 405: f"method {request.method} not allowed here"}
        err = APIError(exc.status_code, msg.get(exc.status_code, str(exc.detail)))
        if exc.status_code == 404:
            err.type = "not_found_error"
        return error_response(err)

    routes = [
        Route("/v1/completions", guarded(completions), methods=["POST"]),
        Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/v1/models/{model:path}", guarded(model_one), methods=["GET"]),
        Route("/v1/load_lora_adapter", guarded(load_lora), methods=["POST"]),
        Route("/v1/unload_lora_adapter", guarded(unload_lora), methods=["POST"]),
        Route("/tokenize", guarded(tokenize), methods=["POST"]),
        Route("/detokenize", guarded(detokenize), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    from .events import EngineEvents, events_endpoint
    from .ui import ui_routes

    events = EngineEvents(engine)
    routes.append(Route("/v1/engine/events", guarded(events_endpoint(server, events)), methods=["GET"]))
    routes += ui_routes(server, engine, guarded, pages=ui)
    middleware = []
    if allowed_origins:
        from starlette.middleware import Middleware
        from starlette.middleware.cors import CORSMiddleware

        middleware.append(Middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                                     allow_headers=["*"], allow_credentials="*" not in allowed_origins))
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error}, middleware=middleware)
    app.state.server = server
    app.state.events = events
    return app


# ---------------------------------------------------------------------------- CLI


def add_ray_options(p: argparse.ArgumentParser) -> None:
    """The Ray Serve options, shown in `conveyor serve --help` (they need the ray extra;
    conveyor.ray.serve reads them when --ray is given)."""
    r = p.add_argument_group("ray serve (needs the ray extra: pip install 'conveyor[ray]')")
    r.add_argument("--ray", action="store_true", help="serve through Ray Serve replicas")
    r.add_argument("--ray-address", default=None,
                   help="an existing cluster (default: $RAY_ADDRESS, else a local Ray started here)")
    g = r.add_mutually_exclusive_group()
    g.add_argument("--replicas", type=int, default=None, help="with --ray: a fixed number of replicas (default: 1)")
    g.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                   help="with --ray: autoscale between MIN and MAX replicas (default: a fixed number)")
    r.add_argument("--target-ongoing-requests", type=float, default=None,
                   help="with --autoscale: requests per replica Serve aims for (default: Serve's)")
    r.add_argument("--max-ongoing-requests", type=int, default=None,
                   help="with --ray: requests one replica takes at once (default: Serve's)")
    # not --max-queued-requests: that name is the engine's own queue limit in each replica
    r.add_argument("--serve-max-queued-requests", type=int, default=None,
                   help="with --ray: requests Serve's router holds before answering 503/429 (-1: no limit; "
                        "default: Serve's)")
    r.add_argument("--queue-full-status", type=int, default=503, choices=[503, 429],
                   help="with --ray: the status of an answer to a full queue")
    r.add_argument("--retry-after", type=float, default=None,
                   help="with --ray: Retry-After seconds on 503/429 (default: none sent)")
    r.add_argument("--cpus-per-replica", type=float, default=1.0,
                   help="with --ray: Ray CPUs per replica; also the engine's thread count unless --num-threads")


def make_parser() -> argparse.ArgumentParser:
    from ..cli_args import DefaultsHelpFormatter, Parser, add_model_arguments, size
    from .tool_parsers import PARSERS

    p = Parser(prog="conveyor serve", formatter_class=DefaultsHelpFormatter,
               description="Run the OpenAI-compatible HTTP server (needs the server extra: "
                           "pip install 'conveyor[server]').")
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (the default is loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port, printed at start)")
    p.add_argument("--api-key", default=os.environ.get("CONVEYOR_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $CONVEYOR_API_KEY, else none)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model names clients may use; answers carry the first (default: a built-in "
                        "model's name, else the model's file stem or folder name)")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                   help="how tool calls are read from answers to tool_choice 'auto' (default: chosen from "
                        "the chat template; hermes when it names no format)")
    p.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                   help="answer 503 (with Retry-After) to a request that would make more than this many wait "
                        "to be scheduled; 0: no limit")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="deadline in seconds of a request without 'timeout'; past it the request ends with "
                        "finish_reason 'timeout' (default: none)")
    p.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="seconds a stop signal (SIGTERM, Ctrl-C) leaves running requests to finish; requests "
                        "that have no token yet, and those still running then, end with 503 engine_closed "
                        "(a stream: an error event, then [DONE]); a second signal ends them at once")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="answer 413 to larger request bodies")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one (default: the tokenizer's)")
    p.add_argument("--allowed-origins", default=None,
                   help="comma-separated origins allowed by CORS ('*' for any; default: no CORS)")
    p.add_argument("--no-ui", dest="ui", action="store_false",
                   help="do not serve the chat page (/) and the live view of batching (/batching); "
                        "by default both are served")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="the server log's level")
    p.add_argument("--no-access-log", action="store_true", help="do not log each HTTP request")
    p.add_argument("--http", default="auto", choices=["auto", "httptools", "h11"],
                   help="HTTP/1.1 implementation ('auto': httptools when installed, as the server extra "
                        "does; h11, pure Python, costs more CPU per streamed chunk)")
    g = p.add_argument_group("engine")
    g.add_argument("--tokenizer", default=None,
                   help="a tokenizer file or folder (default: the model's own)")
    g.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight dtype (default: auto, the checkpoint's)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence, prompt + output (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequences running at once (default: 256)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens computed in one step (default: the engine's choice for the device)")
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV cache block (default: 16)")
    g.add_argument("--kv-cache-memory", type=size, default=None,
                   help="KV cache size, bytes or a size such as 4GiB (default: a share of free memory)")
    g.add_argument("--kv-cache-dtype", default=None, choices=["auto", "float32", "bfloat16", "float16", "int8"],
                   help="KV cache element type (default: auto, the activation dtype; bfloat16 under "
                        "quantized weights)")
    g.add_argument("--quantization", default=None, choices=["q8_0", "q4_0", "q4_1"],
                   help="quantize the weight matrices at load (default: the file's types)")
    g.add_argument("--activation-dtype", default=None, choices=["auto", "float32"],
                   help="GEMM inputs over bf16 weights: 'auto' rounds them to bf16 where the CPU has "
                        "vdpbf16ps; 'float32' keeps them exact (default: auto)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV blocks of a shared prompt prefix (default: on)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="split long prompts over several steps (default: on)")
    g.add_argument("--scheduling", default=None, choices=["continuous", "fcfs", "static", "priority"],
                   help="batching policy; 'priority' orders by the request's 'priority' (default: continuous)")
    g.add_argument("--num-threads", type=int, default=None, help="CPU threads (default: all cores)")
    g.add_argument("--device", default=None, choices=["cpu", "cuda"], help="where to run (default: cpu)")
    g.add_argument("--seed", type=int, default=None,
                   help="the engine's seed for requests without 'seed' (default: 0)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="with --device cuda: the share of GPU memory to use (default: 0.9)")
    g.add_argument("--max-prefill-tokens-while-decoding", type=int, default=None,
                   help="prompt tokens per step while sequences decode (default: 96 on the CPU, 512 on CUDA; "
                        "0: no cap)")
    g.add_argument("--admission-reserve", type=int, default=None,
                   help="a request starts only when the free KV covers the running requests' growth and its "
                        "own by this percentage of the expected remaining output (default: 50; 0: no margin, "
                        "running requests are preempted when the pool runs out)")
    g.add_argument("--adaptive-batch-limit", action="store_true", default=None,
                   help="stop admitting at the batch where decoding reaches 80%% of its rate limit, measured as "
                        "the engine runs (a CPU server's latency under load; default: off)")
    g.add_argument("--enable-lora", action="store_true", default=None,
                   help="serve LoRA adapters over the model (default: off; implied by --lora-modules)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters to serve, each a PEFT folder or GGUF LoRA file; a request's 'model' "
                        "selects one by NAME (default: none)")
    g.add_argument("--max-loras", type=int, default=None,
                   help="adapters resident at once; others wait in host memory (default: 1)")
    g.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank (default: 16)")
    g.add_argument("--lora-dtype", default=None, choices=["auto", "float32", "bfloat16"],
                   help="adapter weights held as (default: auto, bfloat16 over a bf16 or quantized base and "
                        "float32 over a float32 one; bfloat16 halves the bytes a step reads)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. {"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}, or a draft model: {"model": PATH, '
                        '"num_speculative_tokens": 4} (default: none)')
    add_ray_options(p)
    return p


_ENGINE_KNOBS = ("tokenizer", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                 "kv_cache_memory", "kv_cache_dtype", "enable_prefix_caching", "enable_chunked_prefill",
                 "scheduling", "num_threads", "device", "seed", "gpu_memory_utilization", "quantization",
                 "max_prefill_tokens_while_decoding", "admission_reserve", "adaptive_batch_limit", "activation_dtype",
                 "speculative_config", "enable_lora", "max_loras", "max_lora_rank", "lora_dtype")


def engine_kwargs(args) -> dict:
    """The AsyncLLM keyword arguments of parsed `conveyor serve` arguments."""
    knobs = {k: getattr(args, k) for k in _ENGINE_KNOBS if getattr(args, k) is not None}
    knobs["max_queued_requests"] = args.max_queued_requests or None
    return knobs


def _ray_options_given(args) -> list:
    """The Ray Serve options set on a command line without --ray (they would do nothing)."""
    defaults = {"queue_full_status": 503, "cpus_per_replica": 1.0}
    names = ("ray_address", "replicas", "autoscale", "target_ongoing_requests", "max_ongoing_requests",
             "serve_max_queued_requests", "retry_after", "queue_full_status", "cpus_per_replica")
    return ["--" + n.replace("_", "-") for n in names if getattr(args, n, None) != defaults.get(n)]


def app_options(args) -> dict:
    """build_app's options from `conveyor serve`'s parsed flags, in build_app's types (the
    origins split on commas, the adapters as {name: path}); ValueError naming a bad flag.
    Plain serve and each Ray replica build their app from these."""
    lora_modules = {}
    for item in args.lora_modules or ():
        lname, sep, lpath = item.partition("=")
        if not sep or not lname or not lpath:
            raise ValueError(f"--lora-modules takes NAME=PATH, got {item!r}")
        lora_modules[lname] = lpath
    origins = [o.strip() for o in args.allowed_origins.split(",") if o.strip()] if args.allowed_origins else None
    return {"request_timeout": args.request_timeout, "max_body_bytes": args.max_body_bytes,
            "chat_template": args.chat_template, "allowed_origins": origins,
            "tool_call_parser": args.tool_call_parser, "ui": args.ui, "lora_modules": lora_modules or None}


def main(argv=None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    ray_only = _ray_options_given(args)
    if ray_only:
        parser.error(f"{', '.join(ray_only)} only apply with --ray")
    try:
        import uvicorn
        import starlette  # noqa: F401
        if args.http == "httptools":
            import httptools  # noqa: F401
    except ImportError as e:
        print(f"conveyor serve: error: needs the server extra ({e.name} is missing): "
              "pip install 'conveyor[server]'",
              file=sys.stderr)
        return 1
    if not (0 <= args.port <= 65535):
        print(f"conveyor serve: error: --port must be in [0, 65535], got {args.port}", file=sys.stderr)
        return 2
    for flag, value, low in (("--max-queued-requests", args.max_queued_requests, 0),
                             ("--max-body-bytes", args.max_body_bytes, 1)):
        if value < low:
            print(f"conveyor serve: error: {flag} must be >= {low}, got {value}", file=sys.stderr)
            return 2
    if not (0 <= args.shutdown_timeout <= 1e6):
        print(f"conveyor serve: error: --shutdown-timeout must be in [0, 1e6] seconds, got {args.shutdown_timeout}",
              file=sys.stderr)
        return 2
    if args.request_timeout is not None and not (0 < args.request_timeout <= 1e9):
        print("conveyor serve: error: --request-timeout must be in (0, 1e9] seconds", file=sys.stderr)
        return 2
    from .. import AsyncLLM, ConveyorError

    if args.model is None:
        from ..default_model import default_model_path

        args.model = default_model_path()
    else:
        from ..gemma3_model import resolve_model_name

        args.model = resolve_model_name(args.model)  # the Gemma 3 Q4_K_M file by its bare name
    knobs = engine_kwargs(args)
    try:
        options = app_options(args)
    except ValueError as e:
        print(f"conveyor serve: error: {e}", file=sys.stderr)
        return 2
    if options["lora_modules"]:
        knobs["enable_lora"] = True
    try:
        engine = AsyncLLM(args.model, **knobs)
    except (OSError, ValueError, TypeError, ConveyorError) as e:
        print(f"conveyor serve: error: cannot load the model: {e}", file=sys.stderr)
        return 1
    from ..model_name import model_name

    names = args.served_model_name or [model_name(args.model)]
    name = names[0]
    if engine.tokenizer is not None and not args.chat_template and not getattr(engine.tokenizer, "chat_template", None):
        print("conveyor serve: warning: the model has no chat template; /v1/chat/completions formats "
              "conversations as plain 'role: content' lines, which the model was not trained on",
              file=sys.stderr)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"conveyor serve: warning: listening on {args.host} without --api-key", file=sys.stderr)
    try:
        app = build_app(engine, model_name=names, api_key=args.api_key, **options)
    except (OSError, ValueError, APIError) as e:
        engine.close()
        print(f"conveyor serve: error: {e}", file=sys.stderr)
        return 2
    try:
        # Bound here, not by uvicorn, so that --port 0 works: the line below names the real port.
        sock = _bind(args.host, args.port)
    except OSError as e:
        engine.close()
        print(f"conveyor serve: error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    config = uvicorn.Config(app, log_level=args.log_level, access_log=not args.no_access_log,
                            http=args.http, timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_MARGIN_S)
    # A request's preparation (a chat template, a tokenizer in Python) runs on worker
    # threads that hold the GIL while they compute; the event loop waits for it up to
    # the switch interval each time it needs it. 5 ms (Python's default) x the few
    # handoffs of one /health answer came to 100-250 ms under hostile templates; 1 ms
    # keeps it near 30 ms (docs/reliability.md, section 6).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    print(f"conveyor serve: serving {name} at http://{shown}:{port}/v1", file=sys.stderr, flush=True)
    if args.ui:
        print(f"conveyor serve: chat at http://{shown}:{port}/, batching live at http://{shown}:{port}/batching",
              file=sys.stderr, flush=True)
    import signal

    def _exit(signum, frame):
        raise SystemExit(0)

    # uvicorn shuts down gracefully, then re-raises the signal it caught: exit through
    # Python so that the engine below is closed.
    signal.signal(signal.SIGTERM, _exit)
    events, server = app.state.events, app.state.server

    class _Server(uvicorn.Server):
        signals = 0

        def handle_exit(self, sig, frame):
            # streams of engine events never end by themselves: end them, or the shutdown waits
            # for them; generation ends as begin_shutdown says, before uvicorn's own limit
            # (SHUTDOWN_MARGIN_S later) cancels what is left
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            self.signals += 1
            first = self.signals == 1
            if loop is not None:
                loop.call_soon_threadsafe(events.close_all)
                loop.call_soon_threadsafe(server.begin_shutdown, args.shutdown_timeout)
            if first or loop is None:
                super().handle_exit(sig, frame)
            else:  # a second signal: uvicorn stops at once, so the requests' ends go out first
                loop.call_later(SHUTDOWN_MARGIN_S / 2, super().handle_exit, sig, frame)

    try:
        _Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        engine.close()
    return 0


def _bind(host: str, port: int):
    import socket

    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, socktype, proto, _, addr = infos[0]
    # proto must be IPPROTO_TCP (not 0): asyncio sets TCP_NODELAY on accepted sockets only
    # then, and without it Nagle holds each streamed chunk for the client's delayed ACK.
    sock = socket.socket(family, socktype, proto or socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


