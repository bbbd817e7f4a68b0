"""Ray Serve replicas of the OpenAI-compatible server: one AsyncLLM per replica.

    conveyor serve MODEL --ray --replicas 2            # or --autoscale 1:4
    CONVEYOR_MODEL=/path/model.bin serve run conveyor.ray.serve:app
    serve run conveyor.ray.serve:app_builder model=/path/model.bin num_replicas=2

Each replica serves the app `conveyor.serve.build_app` builds (the same routes, errors and
limits as `conveyor serve`), built late through Serve's `__serve_build_asgi_app__` so that
it wraps the replica's own engine. Every response carries `x-conveyor-replica` (the Serve
replica id) and `x-conveyor-node` (the Ray node id).

Event loops: Serve calls the app on its user-code event loop. AsyncLLM picks up the
running loop per request and its dispatcher thread hands outputs to that loop with
call_soon_threadsafe, so any loop works.

Load shedding is Serve's: a replica takes at most `max_ongoing_requests`; past that the
router queues, and past `max_queued_requests` it answers at once with 503 (or 429 with
`queue_full_status=429`) and an optional Retry-After header. The body of that answer is
Ray's plain text, not OpenAI JSON; the openai client raises InternalServerError (503) or
RateLimitError (429) all the same.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import warnings
from typing import Any, Optional

from . import require_ray, threads_for

MODEL_ENV = "CONVEYOR_MODEL"
REPLICA_HEADER = b"x-conveyor-replica"
NODE_HEADER = b"x-conveyor-node"
DEFAULT_NAME = "conveyor"


class _TagResponses:
    """ASGI middleware: adds the replica's and node's ids to every HTTP response."""

    def __init__(self, app, replica: str, node: str):
        self.app = app
        self.headers = [(REPLICA_HEADER, replica.encode()), (NODE_HEADER, node.encode())]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def tagged(message):
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = list(message.get("headers", [])) + self.headers
            await send(message)

        await self.app(scope, receive, tagged)


class ConveyorReplica:
    """The body of one Serve replica: an AsyncLLM and the OpenAI app over it.
    Serve wraps it (serve.ingress, serve.deployment) in `deployment()`."""

    def __init__(self, model: str, engine_kwargs: Optional[dict] = None, *, model_name: str,
                 api_key: Optional[str] = None, app_kwargs: Optional[dict] = None):
        import ray
        from ray import serve

        from .. import AsyncLLM

        self.engine = AsyncLLM(model, **(engine_kwargs or {}))
        self.model_name = model_name
        self.api_key = api_key
        self.app_kwargs = dict(app_kwargs or {})
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node_id = ray.get_runtime_context().get_node_id()

    def __serve_build_asgi_app__(self):
        from ..serve import build_app

        app = build_app(self.engine, model_name=self.model_name, api_key=self.api_key, **self.app_kwargs)
        app.add_middleware(_TagResponses, replica=self.replica_id, node=self.node_id)
        return app

    async def check_health(self):
        """Serve's periodic health check: a closed or broken engine fails it, and Serve
        replaces the replica."""
        if self.engine.closed:
            raise RuntimeError("the replica's engine is closed")
        self.engine.stats()  # calls into the C engine; raises if it is unusable

    def stats(self) -> dict:
        """This replica's engine statistics, with its replica and node ids; through a handle:
        serve.get_deployment_handle("conveyor", app_name=...).stats.remote().result()."""
        return {"replica": self.replica_id, "node": self.node_id, **self.engine.stats()}

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


_DEPLOYMENT = None


def _deployment_class():
    """ConveyorReplica as a Serve ingress deployment (built once, on first use)."""
    global _DEPLOYMENT
    if _DEPLOYMENT is None:
        require_ray("conveyor.ray.serve")
        from ray import serve

        _DEPLOYMENT = serve.deployment(name=DEFAULT_NAME)(serve.ingress()(ConveyorReplica))
    return _DEPLOYMENT


def _autoscaling(spec) -> Optional[dict]:
    if spec is None or isinstance(spec, dict):
        return spec
    if isinstance(spec, str):
        lo, sep, hi = spec.partition(":")
        try:
            lo_n, hi_n = int(lo), int(hi)
        except ValueError:
            lo_n = hi_n = -1
        if not sep or lo_n < 0 or hi_n < max(1, lo_n):
            raise ValueError(f"autoscale must be MIN:MAX with 0 <= MIN <= MAX and MAX >= 1, got {spec!r}")
        return {"min_replicas": lo_n, "max_replicas": hi_n}
    raise TypeError(f"autoscaling_config must be a dict or 'MIN:MAX', got {type(spec).__name__}")


def build(model: str, *, engine_kwargs: Optional[dict] = None, model_name: Optional[str | list] = None,
          api_key: Optional[str] = None, num_replicas: Optional[int] = None,
          autoscaling_config: Any = None, target_ongoing_requests: Optional[float] = None,
          max_ongoing_requests: Optional[int] = None, max_queued_requests: Optional[int] = None,
          queue_full_status: int = 503, retry_after_s: Optional[float] = None,
          ray_actor_options: Optional[dict] = None, health_check_period_s: Optional[float] = None,
          health_check_timeout_s: Optional[float] = None, app_kwargs: Optional[dict] = None,
          name: str = DEFAULT_NAME):
    """A Serve Application (pass it to serve.run) of replicas serving `model`.

    num_replicas, or autoscaling_config (a Serve dict or "MIN:MAX") with
    target_ongoing_requests; max_ongoing_requests (per replica) and max_queued_requests
    (in the router; -1 = unbounded) are Serve's. Requests over max_queued_requests get
    queue_full_status (503 or 429) at once, with Retry-After when retry_after_s is set.
    ray_actor_options["num_cpus"] (default 1) also sets the engine's thread count unless
    engine_kwargs has num_threads. app_kwargs go to conveyor.serve.build_app
    (request_timeout, max_body_bytes).
    """
    if not isinstance(model, str) or not model:
        raise ValueError("model must be a non-empty path")
    if num_replicas is not None and autoscaling_config is not None:
        raise ValueError("give num_replicas or autoscaling_config, not both")
    if num_replicas is not None and (isinstance(num_replicas, bool) or not isinstance(num_replicas, int)
                                     or num_replicas < 1):
        raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
    if queue_full_status not in (503, 429):
        raise ValueError(f"queue_full_status must be 503 or 429, got {queue_full_status!r}")
    auto = _autoscaling(autoscaling_config)
    if target_ongoing_requests is not None:
        if auto is None:
            raise ValueError("target_ongoing_requests needs autoscaling_config")
        auto = {**auto, "target_ongoing_requests": target_ongoing_requests}
    actor_options = dict(ray_actor_options or {})
    actor_options.setdefault("num_cpus", 1)
    engine_kwargs = dict(engine_kwargs or {})
    engine_kwargs.setdefault("num_threads", threads_for(actor_options["num_cpus"]))
    options: dict = {"name": name, "ray_actor_options": actor_options}
    if num_replicas is not None:
        options["num_replicas"] = num_replicas
    if auto is not None:
        options["autoscaling_config"] = auto
    if max_ongoing_requests is not None:
        options["max_ongoing_requests"] = max_ongoing_requests
    if max_queued_requests is not None:
        options["max_queued_requests"] = max_queued_requests
    if queue_full_status != 503 or retry_after_s is not None:
        options["backpressure_config"] = {"status_code": queue_full_status, "retry_after_s": retry_after_s}
    if health_check_period_s is not None:
        options["health_check_period_s"] = health_check_period_s
    if health_check_timeout_s is not None:
        options["health_check_timeout_s"] = health_check_timeout_s
    if api_key is None:
        # as `conveyor serve` does when it listens without a key
        warnings.warn("conveyor.ray.serve: the deployment answers without an API key (pass api_key=...)",
                      UserWarning, stacklevel=2)
    # the served id: the model's own name (as `conveyor serve` gives it), never the
    # full path of the model on the replica's disk
    served = model_name or _served_name(model)
    return _deployment_class().options(**options).bind(
        model, engine_kwargs, model_name=served, api_key=api_key, app_kwargs=app_kwargs)


def _served_name(model: str) -> str:
    from ..model_name import model_name as name_of

    try:
        return name_of(model)
    except (OSError, ValueError):  # the path exists only on the replicas' nodes
        return os.path.basename(os.path.normpath(model)) or DEFAULT_NAME


def app_builder(args: dict):
    """For `serve run conveyor.ray.serve:app_builder model=PATH [num_replicas=N] ...`.
    Keys: model (default $CONVEYOR_MODEL), model_name, api_key, num_replicas, autoscale
    (MIN:MAX), target_ongoing_requests, max_ongoing_requests, max_queued_requests,
    queue_full_status, num_cpus; any other key is an engine knob (max_num_seqs=8, ...)."""
    args = dict(args)
    model = args.pop("model", None) or os.environ.get(MODEL_ENV)
    if not model:
        raise ValueError(f"no model: pass model=PATH or set ${MODEL_ENV}")

    def number(key, kind):
        v = args.pop(key, None)
        if v is None:
            return None
        try:
            return kind(v)
        except (TypeError, ValueError):
            raise ValueError(f"{key} must be a number, got {v!r}") from None

    opts = dict(
        model_name=args.pop("model_name", None), api_key=args.pop("api_key", None),
        num_replicas=number("num_replicas", int), autoscaling_config=args.pop("autoscale", None),
        target_ongoing_requests=number("target_ongoing_requests", float),
        max_ongoing_requests=number("max_ongoing_requests", int),
        max_queued_requests=number("max_queued_requests", int),
        queue_full_status=number("queue_full_status", int) or 503)
    num_cpus = number("num_cpus", float)
    engine_kwargs = {k: _knob(v) for k, v in args.items()}
    return build(model, engine_kwargs=engine_kwargs,
                 ray_actor_options=None if num_cpus is None else {"num_cpus": num_cpus}, **opts)


def _knob(v):
    """serve run passes strings: turn '8', '0.5', 'true' into numbers and bools."""
    if not isinstance(v, str):
        return v
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v


def __getattr__(name):
    # `serve run conveyor.ray.serve:app` reads the model from $CONVEYOR_MODEL; built on
    # first access so that importing this module needs no model.
    if name == "app":
        return app_builder({})
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------- CLI


def make_parser() -> argparse.ArgumentParser:
    from ..serve import make_parser as server_parser

    p = server_parser()  # holds the Ray options too
    p.prog = "conveyor serve --ray"
    return p


def main(argv=None) -> int:
    from ..engine import EngineArgs

    args = make_parser().parse_args(argv)
    try:
        ray = require_ray("conveyor serve --ray")
        from ray import serve
    except ImportError as e:
        print(f"conveyor serve: {e}", file=sys.stderr)
        return 1
    if not (1 <= args.port <= 65535):
        print(f"conveyor serve: --ray needs a fixed --port in [1, 65535], got {args.port}", file=sys.stderr)
        return 2
    from ..models import resolve_model
    from ..server.app import app_options

    # every engine option the server's parser has (the model aside)
    knobs = {k: getattr(args, k) for k in EngineArgs.__dataclass_fields__
             if k != "model" and getattr(args, k, None) is not None}
    try:
        options = {k: v for k, v in app_options(args).items() if v is not None}
        if options.get("lora_modules"):
            knobs["enable_lora"] = True
        # a path, a built-in name or none (the default model), as plain serve takes it
        args.model = resolve_model(args.model)
    except (OSError, ValueError) as e:
        print(f"conveyor serve: error: {e}", file=sys.stderr)
        return 1 if isinstance(e, OSError) else 2
    try:
        app = build(args.model, engine_kwargs=knobs, model_name=args.served_model_name, api_key=args.api_key,
                    num_replicas=args.replicas if args.autoscale is None else None,
                    autoscaling_config=args.autoscale, target_ongoing_requests=args.target_ongoing_requests,
                    max_ongoing_requests=args.max_ongoing_requests,
                    max_queued_requests=args.serve_max_queued_requests,
                    queue_full_status=args.queue_full_status, retry_after_s=args.retry_after,
                    ray_actor_options={"num_cpus": args.cpus_per_replica},
                    app_kwargs=options)
    except (ValueError, TypeError) as e:
        print(f"conveyor serve: error: {e}", file=sys.stderr)
        return 2
    ray.init(address=args.ray_address, log_to_driver=args.log_level == "debug")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name=DEFAULT_NAME, route_prefix="/", blocking=False)
        shown = f"[{args.host}]" if ":" in args.host else args.host
        print(f"conveyor serve: serving {(args.served_model_name or [args.model])[0]} through Ray Serve at "
              f"http://{shown}:{args.port}/v1", file=sys.stderr, flush=True)
        stop.wait()
    except Exception as e:  # noqa: BLE001 - a failed deployment is reported, not a traceback
        print(f"conveyor serve: Ray Serve failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
