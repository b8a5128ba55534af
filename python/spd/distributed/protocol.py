"""The wire protocol between rank 0 and the stages: message tags and the unit messages.

Decode runs as a stream of units: each token rank 0 puts into the pipeline is one unit, and
every stage processes every unit, in order, as soon as its input arrives. Every receive names its
sender. A unit message has two parts:

  header   [op, seq] int64 in host memory: op UNIT or STOP, seq the unit's number (a sanity
           check). The stage reads it on the host: it is host memory on every device, so reading
           it never waits on a device.
  payload  never read on the host by a stage:
             rank 0 -> stage 0        [position, token] int64
             stage s -> stage s + 1   [position] int64, then the output row

How they travel depends on the data group (UnitMessage):

  gloo (the CPU; GPUs with --backend gloo)   ONE message per unit per hop (UNIT_TAG): one host
           uint8 buffer, the header's 16 bytes in front of the payload's. The header is a view
           of that buffer; on a GPU the payload is copied to the device once received.
  NCCL     TWO messages per unit per hop: the header on the gloo control group (HEADER_TAG, so
           it stays host memory) and the payload, device memory, on NCCL (UNIT_TAG).

and besides:
  rank 0 -> last stage       the unit message of every unit but the first (JUDGE_TAG; under NCCL
                             its payload only): the draft the last stage judges when the unit
                             before it leaves
  stage s -> rank 0          its snap of the unit (SNAP_TAG): its anchor rows, then its output
                             row where rank 0 needs it (SnapFormat, `snap_format`)
  last stage -> rank 0       greedy: the verdict [target token, accepted] int64
                             (VERDICT_TAG, VERDICT_SIZE); sampling: the output row rides in its
                             snap (rank 0 judges)

A unit's position sets the stage's KV cache length before its rows are written, so a rollback
is only a lower position: the correction carries it down the pipeline. Units rank 0 dropped
(announced on an optimistic accept, or in flight at a rejection) are still processed by every
stage in the cycles they would idle anyway; rank 0 receives and drops their messages.

The end of a generation is a STOP unit message from rank 0 to stage 0, which each stage passes
on to the next. It has a unit's size (its payload is never read): under gloo a receive must match
its message's size, and under NCCL the payload receive every stage posts is always matched (an
NCCL receive cannot be cancelled).

Buffers come from small rings made when a generation starts (Ring), so the steady loop
allocates none; each ring checks that the buffer it hands out again is no longer in flight.

Messages between two ranks match in the order they were posted (gloo per tag, NCCL per pair of
ranks whatever the tag), so no tag carries a sequence number; under NCCL receives are posted in
the order the peer sends (stage_rank, draft_rank's UnitStream._post_last). The prefill moves
whole prompts on PREFILL_TAG.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Generic, TypeVar

import torch

from spd.errors import InternalError

if TYPE_CHECKING:
    from spd.model.partition import DepthLayout

T = TypeVar("T")

PREFILL_TAG, UNIT_TAG, JUDGE_TAG, SNAP_TAG, VERDICT_TAG, HEADER_TAG = 20, 40, 50, 30, 60, 70
# the device loop's messages (spd.distributed.device_cycle): a cycle's unit, a cycle's snap
CYCLE_UNIT_TAG, CYCLE_SNAP_TAG = 80, 90
GLOO_TAGS = (HEADER_TAG,)  # host headers: the gloo control group even under NCCL
UNIT, STOP = 1, 0          # a header's op


HEADER_BYTES = 16  # [op, seq] int64
UNIT_BYTES = 16    # rank 0's unit payload: [position, token] int64
POS_BYTES = 8      # the position in front of a stage's output row
VERDICT_SIZE = 2   # the last stage's verdict: [target token, accepted] int64


@dataclass(frozen=True)
class SnapFormat:
    """What stage s sends rank 0 about a unit (or, at prefill, about the prompt): a tensor
    [rows, positions, hidden] holding its anchor rows in slot order (`hidden`: their hidden-
    state indices, `slots`: the anchor slots rank 0 keeps them in), then its output row when
    `with_output`. Both sides read it from here (`snap_format`)."""
    hidden: tuple[int, ...]
    slots: tuple[int, ...]
    with_output: bool

    @property
    def rows(self) -> int:
        return len(self.hidden) + int(self.with_output)


def snap_format(layout: DepthLayout, stage: int, *, greedy: bool,
                prefill: bool = False) -> SnapFormat:
    """Stage `stage`'s snap. The last stage adds its output row at prefill (the prompt's last
    row picks the first token on rank 0) and under sampling (rank 0 judges each unit); greedy,
    it sends a verdict instead."""
    pairs = layout.anchors_of_stage(stage)
    last = stage == layout.n - 1
    return SnapFormat(tuple(b for _, b in pairs), tuple(j for j, _ in pairs),
                      last and (prefill or not greedy))


@dataclass(frozen=True)
class TreeUnitFormat:
    """A token tree's unit (spd.runtime.tree: up to W rows at one position) on the wire. Every
    unit has the same size, so a stage reads nothing of it on the host: int64 fields

      position [1], prefix_len [1], tokens [W], slots [W], keys [M], mask [W, M] (0 / 1),
      commit positions [C], commit slots [C]

    then, between stages, the rows [W, hidden]. Rows, keys and commits past the unit's own are
    padding: a padding row writes to the trash slot and a padding key or commit names it (a
    commit of the trash slot to itself). A stage first applies the commits (an accepted row's
    K/V copied from its slot to its position: they were decided after its unit was sent, and
    every stage has run that unit before this one), then runs the rows (Stage.tree_run)."""
    width: int    # W
    keys: int     # M: the uncommitted ancestors' slots and the rows' own, n * W at most
    commits: int  # C: positions committed since the unit before

    @classmethod
    def of(cls, n: int, width: int) -> "TreeUnitFormat":
        return cls(width, n * width, n + 2)

    @property
    def ints(self) -> int:
        w, m, c = self.width, self.keys, self.commits
        return 2 + 2 * w + m + w * m + 2 * c

    @property
    def meta_bytes(self) -> int:
        return 8 * self.ints

    def row_bytes(self, hidden: int, dtype: torch.dtype) -> int:
        return self.meta_bytes + self.width * hidden * torch.empty((), dtype=dtype).element_size()

    def pack(self, position: int, prefix_len: int, tokens: list[int], slots: list[int],
             keys: list[int], mask: list[list[bool]], commits: list[tuple[int, int]],
             trash: int) -> list[int]:
        """The int64 fields of a unit (rank 0, on the host), padded."""
        w, m, c = self.width, self.keys, self.commits
        rows = len(slots)
        if not 1 <= rows <= w or len(keys) > m or len(commits) > c:
            raise InternalError("a tree unit over its format", rows=rows, keys=len(keys),
                                commits=len(commits), format=str(self))
        tokens = list(tokens) + [0] * (w - rows)
        slots = list(slots) + [trash] * (w - rows)
        flat = []
        for r in range(w):
            got = mask[r] if r < rows else []
            flat += [int(b) for b in got] + [0] * (m - len(got))
        keys = list(keys) + [trash] * (m - len(keys))
        cpos = [p for p, _ in commits] + [trash] * (c - len(commits))
        cslot = [q for _, q in commits] + [trash] * (c - len(commits))
        return [position, prefix_len] + tokens + slots + keys + flat + cpos + cslot

    def fields(self, meta: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of a unit's int64 fields meta [ints] (on the device: nothing read on the host);
        the mask is made bool."""
        w, m, c = self.width, self.keys, self.commits
        parts = meta.split([1, 1, w, w, m, w * m, c, c])
        names = ("position", "prefix_len", "tokens", "slots", "keys", "mask", "commit_pos",
                 "commit_slot")
        out = dict(zip(names, parts))
        out["mask"] = out["mask"].view(w, m) != 0
        return out


def _mark(buf: torch.Tensor) -> torch.Tensor:
    buf._spd_header = True  # marks this tensor object (not its views): see is_header
    return buf


def is_header(x) -> bool:
    """Whether `x` is a unit message's header (UnitMessage.header: host memory on every device,
    so reading it never waits on a device). The one thing a stage reads on the host; tests of
    host reads exclude exactly these tensor objects."""
    return isinstance(x, torch.Tensor) and getattr(x, "_spd_header", False) is True


def row_bytes(hidden: int, dtype: torch.dtype) -> int:
    """The payload size of a stage's unit message: the position, then one row of `hidden`."""
    return POS_BYTES + hidden * torch.empty((), dtype=dtype).element_size()


class UnitMessage:
    """The buffers of one unit message on one hop, a send's or a receive's (module docstring).

    folded (the data group is gloo): `wire` uint8 [16 + payload bytes] in host memory is the
    whole message; `header` is its first 16 bytes as int64 [2], `payload` the rest (a device
    copy of it when `device` is a GPU, made by `landed`). Otherwise `header` int64 [2] (host) and
    `payload` uint8 [payload bytes] (on `device`) are two messages."""

    def __init__(self, payload_bytes: int, device, folded: bool):
        self.folded = folded
        self.device = torch.device(device)
        self.busy = False  # a receive's: posted, or its unit not done with (Ring's check)
        if folded:
            self.wire = torch.zeros(HEADER_BYTES + payload_bytes, dtype=torch.uint8)
            self.header = _mark(self.wire[:HEADER_BYTES].view(torch.int64))
            self._host_payload = self.wire[HEADER_BYTES:]
            self.payload = (self._host_payload if self.device.type == "cpu" else
                            torch.zeros(payload_bytes, dtype=torch.uint8, device=self.device))
        else:
            self.wire = self._host_payload = None
            self.header = _mark(torch.zeros(2, dtype=torch.int64))
            self.payload = torch.zeros(payload_bytes, dtype=torch.uint8, device=self.device)

    @property
    def data(self) -> torch.Tensor:
        """What travels on UNIT_TAG (and JUDGE_TAG): the whole message when folded, else the
        payload."""
        return self.wire if self.folded else self.payload

    def set_header(self, op: int, seq: int) -> None:
        self.header[0] = op
        self.header[1] = seq

    def _out(self) -> torch.Tensor:
        """The payload a send goes from: the host bytes when folded (a GPU's values are copied
        there), else the payload itself."""
        return self._host_payload if self.folded else self.payload

    def write_unit(self, pos: int, token) -> None:
        """Rank 0's unit: `token` (an int or a 0-d tensor) at position `pos`."""
        both = self._out()[:UNIT_BYTES].view(torch.int64)
        both[0] = pos
        both[1] = token

    def write_row(self, position: torch.Tensor, row: torch.Tensor) -> None:
        """A stage's unit for the next stage: position [1] int64 and its output row [1, d]."""
        out = self._out()
        out[:POS_BYTES].view(torch.int64).copy_(position.reshape(1))
        out[POS_BYTES:].view(row.dtype).copy_(row.reshape(-1))

    def write_tree(self, meta: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """A tree unit (TreeUnitFormat): its int64 fields meta [ints], then (between stages)
        its rows [W, d]."""
        out = self._out()
        size = meta.numel() * 8
        out[:size].view(torch.int64).copy_(meta)
        if rows is not None:
            out[size:].view(rows.dtype).copy_(rows.reshape(-1))

    def tree(self, fmt: TreeUnitFormat, hidden: int = 0, dtype: torch.dtype | None = None):
        """A tree unit's (int64 fields [ints], rows [W, hidden] or None), views of the
        payload."""
        meta = self.payload[:fmt.meta_bytes].view(torch.int64)
        if not hidden:
            return meta, None
        return meta, self.payload[fmt.meta_bytes:].view(dtype).view(fmt.width, hidden)

    def landed(self) -> None:
        """The message has been received: the payload where the stage computes (a GPU's copy of
        a folded message's host bytes)."""
        if self.folded and self.payload is not self._host_payload:
            self.payload.copy_(self._host_payload)

    def unit(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 0's unit: (position [1] int64, token [1] int64), views of the payload."""
        both = self.payload[:UNIT_BYTES].view(torch.int64)
        return both[:1], both[1:2]

    def row(self, hidden: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A stage's unit: (position [1] int64, row [1, hidden]), views of the payload."""
        buf = self.payload
        return buf[:POS_BYTES].view(torch.int64), buf[POS_BYTES:].view(dtype).view(1, hidden)


class Ring(Generic[T]):
    """`depth` buffers made up front and taken in turn, so the steady decode loop allocates
    none. `depth` must exceed how many can be in flight at once (a receive posted ahead, its
    data still in use, a send not flushed yet: each caller says why its depth is enough);
    `busy(item, owner)`, asked when an item comes round again with the owner given when it was
    last taken, guards that: a ring too shallow raises instead of overwriting a message."""

    def __init__(self, make: Callable[[], T], depth: int, what: str,
                 busy: Callable[[T, object], bool] | None = None):
        self.items = [make() for _ in range(depth)]
        self.owners: list[object] = [None] * depth
        self.what, self.busy, self.i = what, busy, 0

    def take(self, owner: object = None) -> T:
        k = self.i % len(self.items)
        item = self.items[k]
        if self.busy is not None and self.busy(item, self.owners[k]):
            raise InternalError(f"the ring of {self.what} came round to a buffer still in "
                                "flight: it is too shallow", depth=len(self.items))
        self.owners[k] = owner
        self.i += 1
        return item
