"""A KV cache smaller than the context: what one request may ask for, and who is
named when it cannot fit (Python API and the server's request parsing)."""
import pytest

from conveyor import LLM, SamplingParams
from conveyor.server.protocol import APIError, Validator


@pytest.fixture(scope="module")
def small():
    with LLM("stories260K", num_threads=1, kv_cache_memory="64KiB") as llm:
        st = llm.stats()
        room = (st["num_blocks"] - 1) * st["block_size"]
        assert room < st["max_model_len"]  # the cache, not the context, bounds a request here
        assert st["request_room"] == room
        yield llm, room


def test_max_tokens_none_runs_to_what_the_cache_holds(small):
    llm, room = small
    o = llm.generate([[1, 403, 407]], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert o.outputs[0].finish_reason == "length"
    assert len(o.outputs[0].token_ids) == room - 3


def test_a_prompt_the_cache_cannot_hold_is_named(small):
    llm, room = small
    for mt in (None, 1):
        with pytest.raises(ValueError, match="whole KV cache holds") as e:
            llm.generate([[1] * (room + 10)], SamplingParams(max_tokens=mt), use_tqdm=False)
        assert e.value.field == "prompt"
    with pytest.raises(ValueError) as e:  # a prompt that fits, asking for more than the rest
        llm.generate([[1] * 8], SamplingParams(max_tokens=room), use_tqdm=False)
    assert e.value.field == "max_tokens"


def test_chat_default_max_tokens_fits_the_cache(small):
    llm, room = small
    v = Validator(llm.get_tokenizer(), 512, lambda ids, p: None, request_room=room)
    p = v.chat({"messages": [{"role": "user", "content": "Hi"}]})
    assert p.params.max_tokens == room - len(p.prompts[0].ids)
    # the newer name wins when both are sent, and an error names the field sent
    p = v.chat({"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 3, "max_tokens": 9})
    assert p.params.max_tokens == 3
    with pytest.raises(APIError) as e:
        v.chat({"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": -1})
    assert e.value.status == 400 and e.value.param == "max_completion_tokens"
