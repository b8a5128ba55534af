"""Rank 0's side of a batch session's protocol (the session, its messages and pauses:
spd.distributed.batch_stage), shared by what runs in it: SPD (spd.distributed.batch_draft) and
the pipeline without speculation (spd.distributed.batch_pipeline).

`SessionDriver` holds the slots, the queue of sequences waiting for one, the pauses, each
joiner's prefill through the ranks (a chunk a pause with `prefill_chunk`), and the session's
end. What runs in a cycle is the subclass's (`_seat`, `_prefill`, `_start`, `_vacate`,
`_cycle_step`); every rank sees the same messages whichever it is."""
from __future__ import annotations

import json
import time

import torch

from spd import env
from spd.distributed.batch_stage import (
    BatchFormat,
    batch_snap_bytes,
    batch_snap_views,
    session_formats,
)
from spd.distributed.faults import inject_fault
from spd.errors import InternalError, SPDError
from spd.runtime.cycle import end_margin
from spd.runtime.slots import SlotPool, batch_request
from spd.runtime.types import GenerationResult
from spd.runtime.unit import UnitFormat, dead_unit


class SessionDriver(SlotPool):
    """Rank 0's side of a batch session on the stage ranks of `deng` (a DistributedSPDEngine):
    up to `slots` sequences of at most `context` rows each, units of `width` rows. greedy /
    sampled: whether greedy and sampled sequences may join. `judge`: the last stage sends each
    slot's argmax (a greedy chain's); `output`: it sends its output rows; `anchors`: every
    stage sends the anchor rows a drafter reads. `join` queues a sequence (it
    takes a slot at the next pause), `step` runs one cycle of every slot (or, while paused, the
    joins), `leave` frees a slot at once (bubbles from the next cycle), `close` ends the
    session (the stage ranks wait for the next request). Subclasses set their state up, then
    call `_open`."""

    def __init__(self, deng, slots: int, context: int, prefill_chunk: int | None, *,
                 greedy: bool, sampled: bool, width: int, judge: bool, output: bool,
                 anchors: bool = True):
        if getattr(deng, "session", None) is not None:
            raise SPDError("a batch session is open on these ranks: close it first")
        super().__init__(deng.target, slots, context, prefill_chunk)
        rt, eng = deng.rt, deng.engine
        if eng.n < 2:
            raise SPDError("a batch session on the ranks needs n >= 2 stages")
        self.deng, self.rt, self.engine = deng, rt, eng
        t, n = deng.target, eng.n
        self.n, self.ahead, self.width = n, int(rt.config.ahead), width
        self.margin = end_margin(n, self.ahead)
        self.greedy, self.sampled = greedy, sampled
        self.judge, self.output, self.send_anchors = judge, output, anchors
        self.formats = session_formats(eng.layout, output, anchors)
        self.fmt = UnitFormat(n, width)
        self.bfmt = BatchFormat(self.fmt, slots)
        dev, d = t.device, t.hidden_size
        self.msg = torch.zeros(self.bfmt.ints, dtype=torch.int64, device=dev)
        self.ctrl, self.heads, _ = self.bfmt.split(self.msg, d, t.dtype)
        self.dead = dead_unit(self.fmt, context - 1, context - 1).to(dev)
        self.heads.copy_(self.dead)
        S = rt.config.draft_on_stage  # (stage S runs here: no snap of it travels)
        self.snaps = {s: torch.zeros(batch_snap_bytes(f.rows, slots, width, d, t.dtype),
                                     dtype=torch.uint8, device=dev)
                      for s, f in enumerate(self.formats) if (f.rows or s == n - 1) and s != S}
        self.views = {s: batch_snap_views(buf, slots, width, d, t.dtype)
                      for s, buf in self.snaps.items()}
        self.peeks = torch.device(dev).type == "cpu" and not env.replay_check_enabled()
        self.local = None  # stage S of this process, with the draft on a stage (SPD's)
        self.waiting: list = []
        self.freed_at = [-n] * slots  # the first cycle each slot's bubbles went out in
        self.launched = 0             # the session's cycles launched
        self.pause_at: int | None = None
        self.paused = True            # every rank between cycles (before the first, too)
        self.closed = False
        self.pauses = 0
        self.stage_stats: list[dict] = []
        self.fault = rt.fault_here()  # the test hook (DistConfig.fault)

    def _open(self) -> None:
        """The stage ranks into the session (the subclass's set-up done)."""
        self.deng.session = self
        self.deng._request({"op": "batch", "slots": self.slots, "context": self.context,
                            "tree_width": self.width, "judge": self.judge,
                            "output": self.output, "anchors": self.send_anchors,
                            "ahead": self.ahead})

    @classmethod
    def rows_for(cls, engine, prompt_len: int, max_new: int) -> int:
        """A slot's rows for a sequence of `prompt_len` prompt and `max_new` new tokens on
        `engine` (an SPDEngine)."""
        raise NotImplementedError

    def needs(self, prompt_len: int, max_new: int) -> int:
        return self.rows_for(self.engine, prompt_len, max_new)

    # --- what a subclass runs --------------------------------------------------------------------
    def _entry(self, ids, max_new, sampling, rule, on_token):
        """A queued sequence (with .slot, .done, .joined_at, .prefill_s, .ids)."""
        raise NotImplementedError

    def _seat(self, entry, b: int) -> None:
        """`entry` took slot b (its state set up; its units bubbles until it starts)."""
        raise NotImplementedError

    def _prefill(self, entry, req: dict) -> torch.Tensor | None:
        """The chunk `req` went to the ranks: what rank 0 keeps of it -> the prompt's last
        row's final state [1, d] after its last chunk, else None."""
        raise NotImplementedError

    def _start(self, entry, last: torch.Tensor) -> bool:
        """`entry`'s prefill is in: its first token (emitted) -> whether that ended it."""
        raise NotImplementedError

    def _vacate(self, entry, b: int, prefilled: bool, unused: bool) -> None:
        """`entry` left slot b (its units already bubbles): its own state and figures."""
        raise NotImplementedError

    def _cycle_step(self) -> list:
        """One cycle launched (`_launched` after it) and its results read -> the sequences
        that ended."""
        raise NotImplementedError

    # --- sequences ---------------------------------------------------------------------------
    def join(self, ids: torch.Tensor, max_new: int, sampling, rule, on_token=None):
        """Queue `ids` [P]: it takes a free slot at the next pause (its prefill through the
        ranks and its first token, emitted then) and decodes from there."""
        if self.closed:
            raise InternalError("a join after the batch session ended")
        self.check_fits(ids.numel(), max_new)
        if not (self.greedy if sampling.greedy else self.sampled):
            raise SPDError(f"this batch session takes {'greedy' if self.greedy else 'sampled'} "
                           "sequences only")
        entry = self._entry(ids, max_new, sampling, rule, on_token)
        self.waiting.append(entry)
        return entry

    def leave(self, entry, *, unused: bool = False) -> None:
        """The sequence stops now (ended, or its client left): its slot sends bubbles from the
        next cycle (`unused`: it ran no cycle, its slot is as it was)."""
        if entry.slot is None:
            if entry in self.waiting:
                self.waiting.remove(entry)
                entry.done = True
            return
        b = entry.slot
        prefilled = b not in self.prefilling
        if not self.release(entry):
            return
        self.heads[b].copy_(self.dead)
        if not unused and prefilled:
            self.freed_at[b] = self.launched
        self._vacate(entry, b, prefilled, unused)

    def _usable(self) -> list[int]:
        """The free slots whose every unit in flight is a bubble (freed n - 1 cycles ago)."""
        return sorted(b for b in self.free if self.freed_at[b] <= self.launched - (self.n - 1))

    def _place(self, entry, b: int) -> None:
        self.free.remove(b)
        entry.slot, entry.joined_at = b, self.launched
        self._seat(entry, b)
        self.running[b] = entry
        self.prefilling[b] = 0  # (the next prompt row its prefill sends)

    def _resume(self) -> list:
        """While paused: the joins the free slots allow and a chunk of each prompt being
        prefilled (through the ranks into its slot: `prefill_chunk` rows a pause, all at once
        when None), then the cycles, when anything decodes -> the sequences that ended at
        their first token. A prompt whose last chunk is in starts decoding."""
        ended = []
        while self.paused:
            usable = self._usable()
            while self.waiting and usable:
                self._place(self.waiting.pop(0), usable.pop(0))
            parts = self._chunks()
            decoding = bool(self.decoding())
            if not parts and not decoding:
                if not (self.waiting and self.free):
                    return ended  # idle: the stage ranks wait for the next request
                # the free slots still have units in flight: bubbles until they have not
                self.deng._request({"op": "joins", "run": True, "cycle": self.launched,
                                    "joins": []})
                self._unpause()
                return ended
            reqs = [self._chunk_request(e, a, b) for e, a, b in parts]
            self.deng._request({"op": "joins", "run": decoding, "cycle": self.launched,
                                "joins": reqs})
            lasts = []
            for (e, _, b), req in zip(parts, reqs):  # (the messages first: a callback that
                t0 = time.perf_counter()              # raises leaves them paired)
                lasts.append(self._prefill(e, req))
                e.prefill_s += time.perf_counter() - t0
                self.prefilling[e.slot] = b
            if decoding:
                self._unpause()  # (the stage ranks run the cycles from here)
            starts = [(e, last) for (e, _, b), last in zip(parts, lasts)
                      if b == e.ids.numel()]
            for i, (e, last) in enumerate(starts):
                del self.prefilling[e.slot]
                try:
                    done = self._start(e, last)
                except BaseException:
                    for f, _ in starts[i:]:
                        self.prefilling.pop(f.slot, None)
                        self.leave(f, unused=True)
                    raise
                if done:
                    self.leave(e, unused=True)
                    ended.append(e)
            if not decoding and self.decoding():
                self.deng._request({"op": "joins", "run": True, "cycle": self.launched,
                                    "joins": []})
                self._unpause()
        return ended

    def _chunks(self) -> list[tuple]:
        """(entry, a, b): the rows a..b of each prompt being prefilled that go in at this
        pause."""
        out = []
        for slot, a in sorted(self.prefilling.items()):
            e = self.running[slot]
            P = e.ids.numel()
            out.append((e, a, P if self.prefill_chunk is None else min(P, a + self.prefill_chunk)))
        return out

    def _chunk_request(self, e, a: int, b: int) -> dict:
        return {"slot": e.slot, "prompt_ids": e.ids[a:b].tolist(), "prompt_len": b - a,
                "start": a, "anchors": self.send_anchors}

    def _unpause(self) -> None:
        self.paused, self.pause_at = False, None
        self.ctrl.fill_(0)

    def _want_pause(self) -> bool:
        return (self.closed or not self.decoding() or bool(self.waiting and self.free)
                or bool(self.prefilling))

    # --- cycles ------------------------------------------------------------------------------
    def _launched(self) -> bool:
        """A cycle went out -> whether it was the last before the pause (then paused)."""
        self.launched += 1
        if self.launched != self.pause_at:
            return False
        self.paused = True  # (before any callback: one that raises leaves the session in step)
        self.pauses += 1
        return True

    @torch.no_grad()
    def step(self) -> list:
        """While paused, the joins (and the cycles resume when anything decodes); else one
        cycle of every slot and its results read -> the sequences that ended in this step."""
        ended: list = []
        if self.paused:
            ended += self._resume()
            if self.paused:
                return ended
        if self.fault and self.launched == self.fault["cycle"]:
            inject_fault(self.fault)
        ended += self._cycle_step()
        if not self.paused and self.pause_at is None and self._want_pause():
            self.pause_at = self.launched + self.margin
            self.ctrl.fill_(self.pause_at)
        return ended

    def _local_stats(self) -> dict:
        """The figures of the stage in this process (with the draft on a stage)."""
        raise NotImplementedError

    def _graph(self) -> dict:
        """Rank 0's cycle graphs (none where its cycle is not graphed)."""
        return {}

    def close(self) -> None:
        """Ends the session: every sequence left, the cycles run to a pause, the stage ranks'
        figures read; they wait for the next request."""
        if self.closed:
            return
        for entry in list(self.waiting) + list(self.running.values()):
            self.leave(entry)
        self.closed = True
        while not self.paused:
            self.step()
        gen = self.deng._request({"op": "end"})
        self.deng.session = None
        rt, out = self.rt, []
        for r in range(1, rt.world):
            if self.local is not None and r == self.local.S + 1:  # (this process's stage)
                out.append(self._local_stats())
                continue
            key = f"stats/{gen}/{r}"
            out.append(json.loads(rt.store.get(key)))
            rt.store.delete_key(key)
        self.stage_stats = out

    def describe(self) -> dict:
        """The session: cycles, pauses, rank 0's cycle graphs, each stage rank's figures."""
        return {"slots": self.slots, "cycles": self.launched, "pauses": self.pauses,
                "graph": self._graph(), "ranks": self.stage_stats}


def run_session(deng, kind, prompts, max_new_tokens: int, sampling, on_token, *, stop,
                stop_token_ids, max_batch: int | None, describe: dict | None,
                prefill_chunk: int | None) -> list[GenerationResult]:
    """`prompts` through a session of `kind` (a SessionDriver class) on the stage ranks, up to
    `max_batch` at once (default: all, at most 8): SPDEngine.generate's contract for several
    prompts (one result each, in order; on_token(i, id) names the prompt). `describe` (a dict)
    gets the session's figures."""
    eng = deng.engine
    prompts, sampling, max_batch = batch_request(prompts, sampling, max_batch)
    requests = [eng.prepare_request(p, max_new_tokens, stop, stop_token_ids) for p in prompts]
    if not requests:
        return []
    context = max(kind.rows_for(eng, ids.numel(), m) for ids, m, _ in requests)
    batch = kind(deng, max_batch, context, greedy=any(s.greedy for s in sampling),
                 sampled=not all(s.greedy for s in sampling), prefill_chunk=prefill_chunk)
    try:
        entries = []
        for i, (ids, max_new, rule) in enumerate(requests):
            tick = None if on_token is None else (lambda tok, i=i: on_token(i, tok))
            entries.append(batch.join(ids, max_new, sampling[i], rule, tick))
        while batch.running or batch.waiting:
            batch.step()
    finally:  # (an error: the ranks still end the session in step)
        batch.close()
    if describe is not None:
        describe.update(batch.describe())
    return [eng.build_result(e.out, e.stats, rule) for e, (_, _, rule) in zip(entries, requests)]


__all__ = ["SessionDriver", "run_session"]
