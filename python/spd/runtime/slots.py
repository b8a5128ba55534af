"""The slots of a batch (spd.runtime.batch_ar, spd.runtime.batch_spd): up to `slots` sequences
of at most `context` rows each, a slot claimed when a sequence joins and freed when it leaves.

A joining sequence's prompt is prefilled into its slot either at once (`prefill_chunk` None) or
`prefill_chunk` rows a step, before that step's decode of the others: a long prompt then
delays the running sequences by one chunk's work a step instead of its whole prefill."""
from __future__ import annotations

from typing import Iterator

from spd.errors import InternalError, SPDError

_ENDED = object()


def check_prefill_chunk(chunk) -> int | None:
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)
                              or chunk < 1):
        raise SPDError(f"prefill_chunk must be a positive integer or None, got {chunk!r}")
    return chunk


def batch_request(prompts, sampling, max_batch) -> tuple[list, list, int]:
    """Several prompts' checked arguments: (the prompts, one SamplingParams each, the slots:
    `max_batch`, default all of them up to 8)."""
    prompts = list(prompts)
    sampling = [sampling] * len(prompts) if not isinstance(sampling, (list, tuple)) else list(
        sampling)
    if len(sampling) != len(prompts):
        raise SPDError(f"sampling: one SamplingParams for all prompts or one each; got "
                       f"{len(sampling)} for {len(prompts)} prompts")
    if max_batch is None:
        max_batch = min(len(prompts), 8)
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise SPDError(f"max_batch must be a positive integer, got {max_batch!r}")
    return prompts, sampling, max_batch


def chunks(length: int, chunk: int | None) -> Iterator[tuple[int, int]]:
    """(start, stop) of each prefill chunk of a `length`-token prompt."""
    step = chunk or length
    for a in range(0, length, step):
        yield a, min(length, a + step)


class SlotPool:
    """`free` slots (slot 0 first) and the `running` sequences by slot (a sequence whose
    prompt is still being prefilled included); each a batch's entry with `.slot` and `.done`.
    Subclasses say how many rows a sequence needs (`rows_needed`) and hold `n`, the stages it
    keeps rows in flight for."""

    n = 1

    def __init__(self, target, slots: int, context: int, prefill_chunk: int | None = None):
        for name, v in (("slots", slots), ("context", context)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SPDError(f"{name} must be a positive integer, got {v!r}")
        self.target, self.slots, self.context = target, slots, context
        self.prefill_chunk = check_prefill_chunk(prefill_chunk)
        self.free = list(range(slots))
        self.running: dict = {}
        self.prefilling: dict = {}  # slot -> its prefill's remaining chunks (a generator)

    @staticmethod
    def rows_needed(prompt_len: int, max_new: int, n: int) -> int:
        raise NotImplementedError

    def needs(self, prompt_len: int, max_new: int) -> int:
        """A slot's rows for a sequence of `prompt_len` prompt and `max_new` new tokens."""
        return self.rows_needed(prompt_len, max_new, self.n)

    def check_fits(self, prompt_len: int, max_new: int) -> None:
        """A sequence of `prompt_len` prompt tokens and up to `max_new` new ones fits a slot,
        else SPDError naming both."""
        need = self.needs(prompt_len, max_new)
        if need > self.context:
            raise SPDError(f"the prompt ({prompt_len} tokens) and max_new_tokens ({max_new}) "
                           f"need {need} rows of context but a slot holds {self.context}")

    def claim(self, prompt_len: int, max_new: int) -> int:
        """A free slot for a sequence that fits one."""
        if not self.free:
            raise InternalError("no free slot to join", slots=self.slots)
        self.check_fits(prompt_len, max_new)
        slot = min(self.free)  # (the lowest: a batch's ops run over its slots up to the last)
        self.free.remove(slot)
        return slot

    def release(self, entry) -> bool:
        """`entry` leaves its slot (done from now) -> False if it had left already."""
        if self.running.get(entry.slot) is not entry:
            return False
        del self.running[entry.slot]
        self.prefilling.pop(entry.slot, None)
        self.free.append(entry.slot)
        entry.done = True
        return True

    def admit(self, entry, prefill: Iterator) -> None:
        """`entry` takes its slot; `prefill` runs its prompt's prefill a chunk per `next` and
        then starts its decode: here at once, or a chunk a step (`prefill_chunk`)."""
        self.running[entry.slot] = entry
        if self.prefill_chunk is None:
            for _ in prefill:
                pass
        else:
            self.prefilling[entry.slot] = prefill
            self.advance(entry.slot)

    def advance(self, slot: int) -> None:
        """The next chunk of slot `slot`'s prefill (the last one starts its decode)."""
        if next(self.prefilling[slot], _ENDED) is _ENDED:
            self.prefilling.pop(slot, None)

    def advance_prefills(self) -> None:
        """A chunk of each prefill under way (a step's first work)."""
        for slot in list(self.prefilling):
            self.advance(slot)

    def decoding(self) -> list:
        """The running sequences past their prefill, by slot."""
        return [e for _, e in sorted(self.running.items()) if e.slot not in self.prefilling]
