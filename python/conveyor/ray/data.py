"""Offline batch inference on Ray Data: a pool of actors, one AsyncLLM each.

    import ray
    from conveyor.ray.data import build_processor

    ds = ray.data.read_json("prompts.jsonl")            # a "prompt" column
    processor = build_processor("model.bin", sampling_params={"max_tokens": 64, "temperature": 0},
                                batch_size=32, concurrency=4)
    processor(ds).write_parquet("out/")

Each output row is its input row plus `generated_text`, `num_prompt_tokens`,
`num_generated_tokens` and `finish_reason`. A `messages` column (a list of
{"role", "content"} dicts per row) is used instead of `prompt` when
`messages_column` is given; it goes through the tokenizer's chat template, as
LLM.chat does.

Keeping each engine's continuous batcher full: `__call__` is async, so one actor
runs several batches at once (Ray Data runs up to 4 batches of a block at once
for an async UDF, and the actor takes `max_tasks_in_flight` blocks at once);
every prompt of every one of those batches is one request on the same AsyncLLM.
A synchronous `LLM.generate` per batch would leave the engine idle between
batches and never mix two batches in one step.
"""
from __future__ import annotations

import asyncio
from typing import Any, Optional, Union

import numpy as np

from . import require_ray, threads_for

OUTPUT_COLUMNS = ("generated_text", "num_prompt_tokens", "num_generated_tokens", "finish_reason")


def _sampling_params(sp):
    from ..sampling_params import SamplingParams

    if sp is None:
        return SamplingParams()
    if isinstance(sp, SamplingParams):
        return sp
    if isinstance(sp, dict):
        return SamplingParams(**sp)
    raise TypeError(f"sampling_params must be a SamplingParams or a dict, got {type(sp).__name__}")


def _conversation(value, row: int) -> list:
    """A messages cell as a list of plain dicts (Arrow gives lists of dicts, NumPy arrays of them)."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"row {row}: messages must be a non-empty list of {{'role', 'content'}} dicts")
    return [dict(m) if isinstance(m, dict) else m for m in value]


class ConveyorPredictor:
    """A callable class for `ds.map_batches(ConveyorPredictor, compute=ActorPoolStrategy(...))`:
    reads prompts (or chat messages) from a column, adds the generated text, token counts
    and finish reasons. Input batches are dicts of NumPy arrays (batch_format="numpy")."""

    def __init__(self, model: str, engine_kwargs: Optional[dict] = None, sampling_params: Any = None,
                 prompt_column: str = "prompt", messages_column: Optional[str] = None):
        from .. import AsyncLLM

        # only each row's last output is read: the whole completion, built once
        self.params = _sampling_params(sampling_params).clone(output_kind="final_only")
        if self.params.n != 1:
            raise ValueError("batch inference writes one completion per row: sampling_params.n must be 1")
        self.prompt_column = prompt_column
        self.messages_column = messages_column
        self.engine = AsyncLLM(model, **(engine_kwargs or {}))

    def _prompt(self, batch: dict, i: int):
        if self.messages_column is not None:
            from ..llm import chat_prompt

            return chat_prompt(self.engine.tokenizer, _conversation(batch[self.messages_column][i], i))
        p = batch[self.prompt_column][i]
        return p.tolist() if isinstance(p, np.ndarray) else p

    async def _one(self, prompt):
        final = None
        async for out in self.engine.generate(prompt, self.params):
            final = out
        return final

    async def __call__(self, batch: dict) -> dict:
        column = self.messages_column or self.prompt_column
        if column not in batch:
            raise KeyError(f"the dataset has no column {column!r} (columns: {', '.join(batch)})")
        n = len(batch[column])
        outs = await asyncio.gather(*(self._one(self._prompt(batch, i)) for i in range(n)))
        result = dict(batch)
        result["generated_text"] = np.array([o.outputs[0].text for o in outs], dtype=object)
        result["num_prompt_tokens"] = np.array([len(o.prompt_token_ids) for o in outs], dtype=np.int64)
        result["num_generated_tokens"] = np.array([len(o.outputs[0].token_ids) for o in outs], dtype=np.int64)
        result["finish_reason"] = np.array([o.outputs[0].finish_reason for o in outs], dtype=object)
        return result

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


def build_processor(model: str, engine_kwargs: Optional[dict] = None, sampling_params: Any = None, *,
                    batch_size: int = 32, concurrency: Union[int, tuple] = 1, num_cpus: float = 1.0,
                    max_tasks_in_flight: int = 4, prompt_column: str = "prompt",
                    messages_column: Optional[str] = None, predictor: type = None):
    """A function Dataset -> Dataset that generates for every row with `concurrency` actors
    (an int, or (min, max) for an autoscaling pool), each holding one AsyncLLM with
    `num_cpus` Ray CPUs (and as many engine threads, unless engine_kwargs sets num_threads).
    Each actor takes up to `max_tasks_in_flight` blocks at once, and runs several batches of
    each at once, so its engine always has requests to batch. `predictor`: a subclass of
    ConveyorPredictor to use instead (to add or reshape columns)."""
    ray = require_ray("conveyor.ray.data")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if isinstance(max_tasks_in_flight, bool) or not isinstance(max_tasks_in_flight, int) or max_tasks_in_flight < 1:
        raise ValueError(f"max_tasks_in_flight must be an int >= 1, got {max_tasks_in_flight!r}")
    if isinstance(concurrency, int) and not isinstance(concurrency, bool) and concurrency >= 1:
        pool = dict(size=concurrency)
    elif (isinstance(concurrency, tuple) and len(concurrency) == 2
          and all(isinstance(c, int) and not isinstance(c, bool) for c in concurrency)
          and 1 <= concurrency[0] <= concurrency[1]):
        pool = dict(min_size=concurrency[0], max_size=concurrency[1])
    else:
        raise ValueError(f"concurrency must be an int >= 1 or (min, max) with 1 <= min <= max, got {concurrency!r}")
    predictor = ConveyorPredictor if predictor is None else predictor
    if not (isinstance(predictor, type) and issubclass(predictor, ConveyorPredictor)):
        raise TypeError(f"predictor must be a subclass of ConveyorPredictor, got {predictor!r}")
    engine_kwargs = dict(engine_kwargs or {})
    engine_kwargs.setdefault("num_threads", threads_for(num_cpus))
    _sampling_params(sampling_params)  # bad parameters fail here, not in every actor
    # An async actor: the blocks in flight run at once on its event loop.
    compute = ray.data.ActorPoolStrategy(**pool, max_tasks_in_flight_per_actor=max_tasks_in_flight,
                                         max_concurrent_calls_per_actor=max_tasks_in_flight)

    def process(ds):
        return ds.map_batches(
            predictor, batch_size=batch_size, batch_format="numpy", compute=compute, num_cpus=num_cpus,
            fn_constructor_args=(model,),
            fn_constructor_kwargs=dict(engine_kwargs=engine_kwargs, sampling_params=sampling_params,
                                       prompt_column=prompt_column, messages_column=messages_column))

    return process
