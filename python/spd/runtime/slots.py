"""The slots of a batch (spd.runtime.batch_ar, spd.runtime.batch_spd): up to `slots` sequences
of at most `context` rows each, a slot claimed when a sequence joins and freed when it leaves."""
from __future__ import annotations

from spd.errors import InternalError, SPDError


class SlotPool:
    """`free` slots (slot 0 first) and the `running` sequences by slot; each a batch's entry
    with `.slot` and `.done`. Subclasses say how many rows a sequence needs (`rows_needed`) and
    hold `n`, the stages it keeps rows in flight for."""

    n = 1

    def __init__(self, target, slots: int, context: int):
        if target.hybrid:
            raise SPDError("batched decoding (several sequences at once) needs a dense target: "
                           "a hybrid target's linear-attention state is not kept per slot yet")
        for name, v in (("slots", slots), ("context", context)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SPDError(f"{name} must be a positive integer, got {v!r}")
        self.target, self.slots, self.context = target, slots, context
        self.free = list(range(slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.running: dict = {}

    @staticmethod
    def rows_needed(prompt_len: int, max_new: int, n: int) -> int:
        raise NotImplementedError

    def check_fits(self, prompt_len: int, max_new: int) -> None:
        """A sequence of `prompt_len` prompt tokens and up to `max_new` new ones fits a slot,
        else SPDError naming both."""
        need = self.rows_needed(prompt_len, max_new, self.n)
        if need > self.context:
            raise SPDError(f"the prompt ({prompt_len} tokens) and max_new_tokens ({max_new}) "
                           f"need {need} rows of context but a slot holds {self.context}")

    def claim(self, prompt_len: int, max_new: int) -> int:
        """A free slot for a sequence that fits one."""
        if not self.free:
            raise InternalError("no free slot to join", slots=self.slots)
        self.check_fits(prompt_len, max_new)
        return self.free.pop()

    def release(self, entry) -> bool:
        """`entry` leaves its slot (done from now) -> False if it had left already."""
        if self.running.get(entry.slot) is not entry:
            return False
        del self.running[entry.slot]
        self.free.append(entry.slot)
        entry.done = True
        return True
