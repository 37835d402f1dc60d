"""The core's books of the LoRA adapters: which are registered, which sits in which GPU slot.

The runner holds `max_loras` slots of adapter weights (runner/lora.py). A request under an adapter
is admitted only while the running requests use fewer than `max_loras` adapters, or its own is
among them (vLLM's rule), so a step never needs more slots than there are; it then gets its adapter's
slot, placed there if needed: a free slot, else the least recently used one no running request uses.
The step carries the placements (`take_loads`) so every rank loads them before its forward pass.
A request whose adapter cannot be placed waits, and the requests behind it are admitted meanwhile.
No torch in this module.
"""

from __future__ import annotations

from collections import Counter, OrderedDict


class LoRASlots:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.adapters: dict[str, str] = {}  # registered: name -> path
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # placed, least recently used first
        self._free = list(range(max_loras))
        self._loads: list[tuple[int, str, str]] = []  # (slot, name, path) placed since the last step
        self.slot_loads_total: Counter[str] = Counter()  # placements into a slot, by adapter

    def register(self, name: str, path: str) -> None:
        """Add (or re-point) an adapter; a re-pointed one is loaded again where it is next used."""
        if self.adapters.get(name) not in (None, path):
            self._release(name)
        self.adapters[name] = path

    def unregister(self, name: str) -> None:
        self.adapters.pop(name)
        self._release(name)

    def place(self, name: str, in_use: set[str]) -> int | None:
        """The slot of adapter `name` for a request admitted now, placing it if needed; None when
        every slot holds an adapter in `in_use` (the running requests')."""
        slot = self._slot_of.get(name)
        if slot is not None:
            self._slot_of.move_to_end(name)
            return slot
        if self._free:
            slot = self._free.pop(0)
        else:
            evicted = next((n for n in self._slot_of if n not in in_use), None)
            if evicted is None:
                return None
            slot = self._slot_of.pop(evicted)
        self._slot_of[name] = slot
        self._loads.append((slot, name, self.adapters[name]))
        self.slot_loads_total[name] += 1
        return slot

    def take_loads(self) -> list[tuple[int, str, str]]:
        loads, self._loads = self._loads, []
        return loads

    def _release(self, name: str) -> None:
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self._free.append(slot)
            self._loads = [load for load in self._loads if load[1] != name]
