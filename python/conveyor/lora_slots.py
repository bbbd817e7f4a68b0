"""The engine's LoRA adapter slots, seen from Python: which adapter is resident in
which of the ``max_loras`` slots, how many live requests use each, and the LRU
order in which idle ones are evicted when a new adapter needs a slot. Adapters
read once stay in host memory (their arrays), so a swap back in reads no file.

A request whose adapter cannot get a slot (every slot used by running requests)
waits in EngineCore until one is released; a slot in use is never changed.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from .lora import MODULES, LoRAAdapter, LoRARequest, load_adapter


class LoRASlots:
    def __init__(self, engine, model_config: dict, n_slots: int, max_rank: int):
        self._engine = engine  # conveyor._core.Engine
        self._cfg = model_config
        self.n_slots = n_slots
        self.max_rank = max_rank
        self._host: dict[int, tuple[LoRARequest, LoRAAdapter]] = {}  # id -> read adapter
        self._slot_of: dict[int, int] = {}
        self._resident: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
        self._users: dict[int, int] = {}    # id -> running requests that use its slot
        self._waiters: dict[int, int] = {}  # id -> requests waiting for a slot for it
        self._forget_when_idle: set[int] = set()
        self.swaps = 0  # adapters loaded into a slot
        self.evictions = 0  # of them, loads that took an idle adapter's slot
        self.requests: dict[str, int] = {}  # adapter name -> requests finished under it
        self.tokens: dict[str, int] = {}    # adapter name -> their output tokens

    def is_read(self, req: LoRARequest) -> bool:
        """Whether the adapter is in host memory (ValueError when its id names another path)."""
        known = self._host.get(req.lora_int_id)
        if known is not None and known[0].lora_path != req.lora_path:
            raise ValueError(f"lora_int_id {req.lora_int_id} is already {known[0].lora_name!r} at "
                             f"{known[0].lora_path}, not {req.lora_path}")
        return known is not None

    def load(self, req: LoRARequest) -> LoRAAdapter:
        """Reads the adapter's files (LoRAError on a bad one); touches no state, so the
        caller may run it without the engine's lock."""
        return load_adapter(req.lora_path, self._cfg, self.max_rank)

    def keep(self, req: LoRARequest, adapter: LoRAAdapter) -> None:
        """Holds a loaded adapter in host memory (another thread may have kept it first)."""
        if not self.is_read(req):
            self._host[req.lora_int_id] = (req, adapter)

    def forget(self, lora_id: int) -> bool:
        """Drops an idle adapter from host memory and its slot. While requests use it or
        wait for it, False: it is dropped when the last of them ends."""
        if self._users.get(lora_id, 0) > 0 or self._waiters.get(lora_id, 0) > 0:
            if lora_id in self._host:
                self._forget_when_idle.add(lora_id)
            return False
        self._drop(lora_id)
        return True

    def _drop(self, lora_id: int) -> None:
        self._forget_when_idle.discard(lora_id)
        slot = self._slot_of.pop(lora_id, None)
        if slot is not None:
            self._resident.pop(lora_id, None)
            self._engine.lora_unload(slot)
        self._host.pop(lora_id, None)

    def acquire(self, lora_id: int) -> Optional[int]:
        """The slot holding adapter lora_id (keep() first), loading it into a free or the
        least recently used idle slot; None when every slot is in use (the caller waits)."""
        slot = self._slot_of.get(lora_id)
        if slot is None:
            used = set(self._slot_of.values())
            free = [s for s in range(self.n_slots) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next((i for i in self._resident if self._users.get(i, 0) == 0), None)
                if victim is None:
                    return None
                slot = self._slot_of.pop(victim)
                del self._resident[victim]
                self.evictions += 1
            ad = self._host[lora_id][1]
            pairs = [(layer, MODULES.index(mod), a, b) for (layer, mod), (a, b) in ad.weights.items()]
            self._engine.lora_load(slot, ad.scale, pairs)
            self.swaps += 1
            self._slot_of[lora_id] = slot
        self._resident[lora_id] = None
        self._resident.move_to_end(lora_id)
        self._users[lora_id] = self._users.get(lora_id, 0) + 1
        return slot

    def release(self, lora_id: int) -> None:
        self._users[lora_id] = self._users.get(lora_id, 0) - 1
        self._leave(lora_id, self._users)

    def wait(self, lora_id: int) -> None:
        """A request waits for a slot for this adapter."""
        self._waiters[lora_id] = self._waiters.get(lora_id, 0) + 1

    def waiter_left(self, lora_id: int) -> None:
        """A waiting request got its slot or ended."""
        self._waiters[lora_id] = self._waiters.get(lora_id, 0) - 1
        self._leave(lora_id, self._waiters)

    def _leave(self, lora_id: int, counts: dict) -> None:
        if counts[lora_id] <= 0:
            del counts[lora_id]
        if lora_id in self._forget_when_idle and not self._users.get(lora_id) and not self._waiters.get(lora_id):
            self._drop(lora_id)

    def stats(self, n_waiting: int) -> dict:
        """lora_swaps (adapters loaded into a slot so far), lora_evictions (of those, the loads
        that evicted an idle adapter from its slot), lora_resident (adapters in slots),
        lora_requests_waiting (requests waiting for a slot), lora_requests / lora_tokens
        ({adapter name: requests finished, output tokens}; counted by count_finished)."""
        return {"lora_swaps": self.swaps, "lora_evictions": self.evictions, "lora_resident": len(self._slot_of),
                "lora_requests_waiting": n_waiting,
                "lora_requests": dict(self.requests), "lora_tokens": dict(self.tokens)}

    def count_finished(self, name: str, n_tokens: int) -> None:
        self.requests[name] = self.requests.get(name, 0) + 1
        self.tokens[name] = self.tokens.get(name, 0) + n_tokens

    def resident(self) -> dict[int, int]:
        """{adapter id: slot} of the adapters loaded now."""
        return dict(self._slot_of)
