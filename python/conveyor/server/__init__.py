"""The OpenAI-compatible HTTP server, in three parts: protocol (request fields,
validation, errors), serving (completions and chat on the engine) and app
(routes, middleware, CLI). `conveyor.serve` re-exports build_app and main."""
from .app import build_app, main, make_parser  # noqa: F401
