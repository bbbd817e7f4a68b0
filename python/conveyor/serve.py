"""`conveyor serve`: an OpenAI-compatible HTTP server over one AsyncLLM.

    conveyor serve MODEL [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine knobs]
    python -m conveyor.serve MODEL ...

A thin alias of the conveyor.server package (protocol, serving, app), kept so
that `conveyor.serve.build_app` / `main` and `python -m conveyor.serve` work.
"""
from .server.app import build_app, engine_kwargs, main, make_parser  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())
