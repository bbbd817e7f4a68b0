"""The template chunk encoder gives byte for byte what json-encoding the chunk dict gives."""
import json

import pytest

from conveyor.server.chunks import ChunkEncoder
from conveyor.server.protocol import dumps

TEXTS = ["", "Once", " upon a time", 'quote " and \\ backslash', "new\nline\ttab", "\u00e9t\u00e9 \u4e2d\u6587 \U0001f600",
         "\x00\x1f control", "\ufffd"]


def reference(rid, created, model, chat, include_usage, text, fin, stop_reason):
    if chat:
        choice = {"index": 0, "delta": {"content": text} if (text or fin is None) else {}, "logprobs": None,
                  "finish_reason": fin}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": fin}
    if fin is not None:
        choice["stop_reason"] = stop_reason
    c = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
         "model": model, "choices": [choice]}
    if include_usage:
        c["usage"] = None
    return f"data: {dumps(c)}\n\n"


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_events_equal_json_dumps(chat, include_usage):
    for model in ("stories", 'we"ird/\u00fcmodel'):
        enc = ChunkEncoder("cmpl-abc", 1700000000, model, chat, include_usage)
        for text in TEXTS:
            for fin, stop in ((None, None), ("length", None), ("stop", 2), ("stop", "The end"), ("timeout", None)):
                got = enc.event(text, fin, stop)
                assert got == reference("cmpl-abc", 1700000000, model, chat, include_usage, text, fin, stop)
                json.loads(got[len("data: "):])  # and it is JSON
