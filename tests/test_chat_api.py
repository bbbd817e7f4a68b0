"""LLM.chat takes a conversation in OpenAI's forms (text parts, an assistant message with
no content) as the server does, and refuses an empty one, alone or in a batch."""
import pytest

from conveyor import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6)
pytestmark = pytest.mark.filterwarnings("ignore:this model has no chat template")  # stories260K has none


@pytest.fixture(scope="module")
def llm():
    with LLM("stories260K", num_threads=1) as engine:
        yield engine


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_text_parts_and_none_content_read_as_text(llm):
    plain = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": ""},
             {"role": "user", "content": "Tell a story"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
             {"role": "assistant", "content": None},
             {"role": "user", "content": [{"type": "text", "text": "Tell a story"}]}]
    a, b = llm.chat(plain, GREEDY, use_tqdm=False), llm.chat(parts, GREEDY, use_tqdm=False)
    assert a[0].prompt_token_ids == b[0].prompt_token_ids and _ids(a) == _ids(b)


@pytest.mark.parametrize("content, exc, match", [
    ([{"type": "image_url", "image_url": {"url": "x"}}], ValueError, r"messages\[0\]\['content'\]\[0\]"),
    ([{"type": "text", "text": 5}], TypeError, r"\[0\]\.text"),
    (["hi"], TypeError, r"content part"),
    (5, TypeError, r"messages\[0\]\['content'\]"),
])
def test_bad_content_is_named(llm, content, exc, match):
    with pytest.raises(exc, match=match):
        llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)


def test_an_empty_conversation_is_refused_even_in_a_batch(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.chat([[{"role": "user", "content": "a"}], []], GREEDY, use_tqdm=False)
