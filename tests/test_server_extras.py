"""Server niceties: --api-key, --served-model-name (several names), --chat-template,
/tokenize, /detokenize, CORS (--allowed-origins) and the naming of ignored body fields,
on a real server process."""
from __future__ import annotations

from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from conveyor.bench.serve import OwnServer  # noqa: E402
from conveyor.tokenizer import load_tokenizer  # noqa: E402
from conveyor.testing import STORIES_DIR  # noqa: E402

MODEL = STORIES_DIR / "stories260K.bin"
pytestmark = pytest.mark.skipif(not MODEL.is_file(), reason=f"{MODEL} not found")
TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}\n{% endfor %}ANSWER:"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tpl = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    tpl.write_text(TEMPLATE)
    s = OwnServer(str(MODEL), ("--api-key", "sekrit", "--served-model-name", "tiny-story", "story-alias",
                               "--chat-template", str(tpl), "--allowed-origins", "https://app.example"),
                  timeout=60.0)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30.0, trust_env=False,
                      headers={"Authorization": "Bearer sekrit"}) as c:
        yield c


def test_api_key(server):
    ok = openai.OpenAI(base_url=server.url + "/v1", api_key="sekrit", max_retries=0,
                       http_client=httpx.Client(trust_env=False, timeout=30.0))
    assert [m.id for m in ok.models.list().data] == ["tiny-story", "story-alias"]
    r = ok.completions.create(model="tiny-story", prompt="Once", max_tokens=3)
    assert r.model == "tiny-story"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0,
                        http_client=httpx.Client(trust_env=False, timeout=30.0))
    with pytest.raises(openai.AuthenticationError) as ei:
        bad.completions.create(model="tiny-story", prompt="Once", max_tokens=3)
    assert ei.value.status_code == 401
    with httpx.Client(base_url=server.url, trust_env=False) as anon:
        r = anon.post("/tokenize", json={"prompt": "hi"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_tokenize_detokenize_round_trip(http):
    tok = load_tokenizer(str(MODEL))
    text = "Once upon a time, a little dog ran."
    r = http.post("/tokenize", json={"model": "tiny-story", "prompt": text}).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] > 0
    back = http.post("/detokenize", json={"model": "tiny-story", "tokens": r["tokens"]}).json()
    assert back == {"prompt": text}
    r = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert r["tokens"] == tok.encode(text, add_special_tokens=False)
    bad = http.post("/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_chat_template_override(http):
    msgs = [{"role": "user", "content": "Hello"}]
    r = http.post("/tokenize", json={"messages": msgs}).json()
    tok = load_tokenizer(str(MODEL))
    assert r["tokens"] == tok.encode("<<user>>Hello\nANSWER:", add_special_tokens=False)
    c = http.post("/v1/chat/completions", json={"model": "tiny-story", "messages": msgs, "max_tokens": 2})
    assert c.status_code == 200 and c.json()["usage"]["prompt_tokens"] == r["count"]


def test_cors(server):
    with httpx.Client(base_url=server.url, trust_env=False) as c:
        pre = c.options("/v1/chat/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in pre.headers["access-control-allow-methods"]
        other = c.options("/v1/chat/completions", headers={
            "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
        assert other.status_code == 400
        assert "access-control-allow-origin" not in other.headers


def test_served_model_names(server, http):
    """Every served name works; answers carry the first; any other name is a 404 naming them."""
    for name in ("tiny-story", "story-alias"):
        r = http.post("/v1/completions", json={"model": name, "prompt": "Once", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "tiny-story"
        card = http.get(f"/v1/models/{name}")
        assert card.status_code == 200 and card.json()["id"] == name
    r = http.post("/v1/completions", json={"model": "stories260K", "prompt": "Once", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "'tiny-story', 'story-alias'" in r.json()["error"]["message"]


def test_ignored_fields_are_named(server, http):
    """A misspelled field is named in a response header and in the server log; the fields
    read (and OpenAI's no-effect ones such as 'user') are not."""
    body = {"model": "tiny-story", "prompt": "Once", "max_tokens": 2, "temprature": 0.5, "user": "u1",
            "top_p": 1.0}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.headers["x-conveyor-ignored-fields"] == "temprature"
    chat = {"model": "tiny-story", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "prompt": "x", "frobnicate": 1}
    with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["x-conveyor-ignored-fields"] == "frobnicate,prompt"
        r.read()
    r = http.post("/v1/chat/completions", json={**chat, "prompt": None, "frobnicate": None, "temperature": 0})
    assert r.status_code == 200 and "x-conveyor-ignored-fields" in r.headers  # present, even if null
    r = http.post("/v1/completions", json={k: v for k, v in body.items() if k != "temprature"})
    assert "x-conveyor-ignored-fields" not in r.headers
    log = server.read_log()
    assert "request fields ignored" in log and "temprature" in log and "frobnicate,prompt" in log
