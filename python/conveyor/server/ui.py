"""The browser pages of `conveyor serve`: the chat page at /, the live view of
continuous batching at /batching, their files under /static/, and the JSON the
pages show the engine's settings from (GET /v1/engine/settings).

The pages are plain HTML, CSS and JavaScript modules shipped in the package
(server/static/), read once at start and served from memory; nothing is fetched
from anywhere but this server, and a Content-Security-Policy says so to the
browser. The pages hold no secret and are served without the API key; what they
fetch from /v1/* sends the key the visitor typed (kept in the browser's
localStorage) as a bearer token.
"""
from __future__ import annotations

from pathlib import Path

STATIC_DIR = Path(__file__).resolve().parent / "static"
_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
          ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml"}
# Only this server: no inline script, no other origin, no plugin, no framing.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
PAGES = {"/": "index.html", "/batching": "batching.html"}
# Settings that name files on the server's machine are not shown to clients.
_PRIVATE_SETTINGS = ("model", "tokenizer")


def load_static(folder: Path = STATIC_DIR) -> dict:
    """{file name: (bytes, media type)} of the pages' files."""
    files = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.suffix in _TYPES:
            files[p.name] = (p.read_bytes(), _TYPES[p.suffix])
    missing = [name for name in PAGES.values() if name not in files]
    if missing:
        raise OSError(f"the server's page files are missing from {folder}: {', '.join(missing)}")
    return files


def public_settings(engine, server) -> dict:
    """What GET /v1/engine/settings answers: the served name, the engine's settings
    (without file paths) and its KV cache's size."""
    settings = {k: v for k, v in engine.settings().items() if k not in _PRIVATE_SETTINGS}
    spec = settings.get("speculative_config")
    if isinstance(spec, dict):  # a draft model's path stays private too
        settings["speculative_config"] = {k: v for k, v in spec.items() if k != "model"}
        if "model" in spec:
            settings["speculative_config"]["draft_model"] = Path(str(spec["model"])).name
    try:
        st = engine.stats()
    except Exception:  # noqa: BLE001 - a closed engine: no figures
        st = {}
    return {"model": server.model_name, "max_model_len": server.max_model_len,
            "settings": settings,
            "kv_cache": {"blocks_total": st.get("blocks_total"), "block_size": st.get("block_size"),
                         "bytes": st.get("kv_cache_bytes")},
            "max_num_seqs": st.get("max_num_seqs"),
            "max_num_batched_tokens": st.get("max_num_batched_tokens")}


def ui_routes(server, engine, guarded, *, pages: bool) -> list:
    """The routes: the settings JSON always (guarded: the app's error wrapper); the pages
    and their files unless pages=False."""
    from starlette.exceptions import HTTPException
    from starlette.responses import Response
    from starlette.routing import Route

    from .serving import json_response

    async def settings(request):
        server.check_auth(request)
        return json_response(public_settings(engine, server))

    routes = [Route("/v1/engine/settings", guarded(settings), methods=["GET"])]
    if not pages:
        return routes
    files = load_static()
    headers = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
               "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}

    def serve(name: str):
        body, media_type = files[name]
        return Response(body, media_type=media_type, headers=headers)

    async def page(request):
        return serve(PAGES[request.url.path])

    async def static(request):
        name = request.path_params["name"]
        if name not in files:
            raise HTTPException(404)
        return serve(name)

    routes += [Route(path, page, methods=["GET", "HEAD"]) for path in PAGES]
    routes.append(Route("/static/{name}", static, methods=["GET", "HEAD"]))
    return routes
