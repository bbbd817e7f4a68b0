"""The streamed chunks of one completion with one choice, encoded by templates.

A streamed request sends one server-sent event per engine step. Encoding a whole chunk
dict with json.dumps for each of them costs more than everything else the server does
per token, yet only the text and, at the end, the finish reason change. The encoder
builds the constant head and tail of the event once and encodes just the text (the C
string encoder of the json module). Its output is byte for byte what encoding the
chunk dict with protocol.dumps gives (tests/test_stream_encoder.py checks it).
"""
from __future__ import annotations

from json.encoder import encode_basestring  # the C encoder, as json.dumps(..., ensure_ascii=False)
from typing import Optional, Union

from .protocol import dumps


class ChunkEncoder:
    """Server-sent events of a completion ("text_completion") or chat completion
    ("chat.completion.chunk") stream with the single choice 0 and no logprobs."""

    __slots__ = ("head", "open_tail", "usage", "chat")

    def __init__(self, rid: str, created: int, model: str, chat: bool, include_usage: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"
        self.chat = chat
        self.head = (f'data: {{"id":{encode_basestring(rid)},"object":"{obj}","created":{int(created)},'
                     f'"model":{encode_basestring(model)},"choices":[{{"index":0,'
                     + ('"delta":' if chat else '"text":'))
        self.usage = ',"usage":null' if include_usage else ""
        self.open_tail = ',"logprobs":null,"finish_reason":null}]' + self.usage + "}\n\n"

    def event(self, text: str, finish_reason: Optional[str] = None,
              stop_reason: Union[int, str, None] = None) -> str:
        """One event: new text, and the finish reason when the choice ends."""
        if self.chat:
            body = f'{{"content":{encode_basestring(text)}}}' if (text or finish_reason is None) else "{}"
        else:
            body = encode_basestring(text)
        if finish_reason is None:
            return self.head + body + self.open_tail
        return (f'{self.head}{body},"logprobs":null,"finish_reason":{encode_basestring(finish_reason)},'
                f'"stop_reason":{dumps(stop_reason)}}}]{self.usage}}}\n\n')
