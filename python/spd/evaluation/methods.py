"""The decoding methods the comparison grid runs, each described once.

Terms (`spd.evaluation.cost_model` measures the times):
  t_fwd   one full target forward at one row (what AR pays per token)
  t_i     stage i's forward (its layers); t_head the final norm + LM head
  t_draft one drafter call (measured inside the method's own decoding)
  S       the theoretical speedup alpha * n (EAGLE-3: tokens per verification round)
  cycle   Costs.cycle: the slowest device's work in a cycle, at least the balanced t_fwd / n

Each cost is charged where it runs (docs/definitions.md):
  ar      1
  pp      t_fwd / max(t_fwd, sum t_i + t_head)   a token passes the n stages one after another;
                                                the last stage computes the head
  spd     S / n * t_fwd / cycle, cycle over: every stage, the last one with t_head when greedy
          (it judges the draft after its layers); the draft rank's t_draft, plus t_head under
          sampling (there the draft rank judges)
  spd-nd  SPD on n devices (no draft rank: the PDM shares stage 0's device): S / n * t_fwd /
          cycle, cycle = the slowest stage of the balanced split of the measured layer costs
          (Costs.balanced_cycle), stage 0 paying t_draft (+ t_head under sampling, it judges
          there) and the last stage t_head when greedy. Its counts are SPD's (the same
          drafters); the split is charged in the cost, as the n-device mode would run it
  spd-tree  SPD drafting a token tree of width W = TREE_WIDTH (spd.runtime.drafting): as spd, every
          stage's time scaled by t_chunk(W) / t_fwd (a stage computes up to W rows a cycle:
          charged as W rows through the weights cost on this device, measured), t_draft its
          tree step as it ran
  ppsd    S / n * t_fwd / cycle, cycle = max_i(t_i, the last with t_head) + t_draft (it drafts
          after each step: on the critical path; the last stage verifies)
  eagle3  S * t_fwd / (k * t_draft + max(t_fwd, t_chunk(k+1)))   k serial drafts, then one
          verification pass (a chunk of k+1 rows costs at least one row's forward)
So the adjusted speedup never exceeds S (tests/evaluation/test_grid.py holds it for every
method, n and temperature).

Batched rows (B sequences at once, issue 54): ar, pp and spd also project their tokens/s over
all B sequences (`Method.batched`; the formulas, each cost charged where it runs, are in
`spd.evaluation.batched`).

A `Method` says how the grid lays out its cells (once per device count n, per PDM depth),
how many devices it occupies, its draft-cost-adjusted speedup over AR on one device, and how to
build its decoder. The grid and the report branch on these fields, never on the name.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from spd.baselines import ppsd
from spd.baselines.eagle import METHOD as EAGLE3
from spd.draft.pdm import SHIPPED_DIR, find_shipped_pdm
from spd.errors import SPDError
from spd.evaluation import batched as batch_rows
from spd.evaluation.cost_model import Costs
from spd.model.partition import DepthLayout
from spd.runtime.engine import SPDEngine


@dataclass(frozen=True)
class Method:
    name: str
    staged: bool                     # one cell per stage count n (else one device, n = 1)
    per_depth: bool                  # one cell per PDM depth L_s as well
    measured_for_real: bool          # this process runs it as deployed: its tok/s ratio counts
    devices: Callable[[int], int]    # devices occupied at n stages
    # (costs, n, S, t_draft, draft steps, greedy) -> draft-cost-adjusted speedup over AR
    adjusted: Callable[[Costs, int, float, float, int, bool], float]
    # (target, n, L_s, search folders, lookup) -> (decoder or None, source or why skipped)
    build: Callable
    is_reference: bool = False       # AR: the outputs every greedy check compares with
    derived_from_reference: bool = False  # PP: computes exactly what AR does, counts follow
    # decoder -> rows of the full-forward chunks the cost model must time for `adjusted`
    # (Costs.chunk_s; EAGLE-3: its verification pass of k+1 tokens); None: no chunk
    cost_chunks: Callable[[object], list[int]] | None = None
    # (costs, n, B, S, t_draft, greedy) -> projected tokens/s over B sequences decoding at once
    # (spd.evaluation.batched; None from it: a piece not measured); None: no batched row (the
    # method does not run batched)
    batched: Callable[[Costs, int, int, float, float, bool], float | None] | None = None

    def config(self, n: int, pdm_layers: int | None) -> str:
        """The row label of the report for one configuration."""
        if not self.staged:
            return self.name
        if self.per_depth:
            return f"{self.name} n={n} L_s={pdm_layers}"
        return f"{self.name} n={n}"


def _build_plain(target, n, pdm_layers, search, lookup):
    return SPDEngine(target, n_stages=1), "none"


def _build_eagle(target, n, pdm_layers, search, lookup):
    from spd.baselines.eagle import find_eagle
    from spd.baselines.eagle_decode import EagleDecoder
    head = find_eagle(target, search=search)
    if head is None:
        return None, ("no trained EAGLE-3 head for this target: train one with "
                      f"`python -m spd train --method {EAGLE3} --out DIR` and pass "
                      "--checkpoint-dir")
    return EagleDecoder(target, head=head), str(head)


def _pdm_builder(method: str, layout_of: Callable, **engine_options):
    """SPD and PPSD both decode with a PDM (PPSD is a PDM configuration: spd.baselines.ppsd);
    `engine_options` go to SPDEngine (a tree's width)."""
    def build(target, n, pdm_layers, search, lookup):
        if engine_options.get("tree_width", 1) > 1 and target.hybrid:
            return None, "tree drafting is not supported on hybrid targets"
        layout = layout_of(target.num_layers, n)
        path = find_shipped_pdm(target, layout, num_layers=pdm_layers, method=method,
                                search=search)
        if path is None:
            what = f"--pdm-layers {pdm_layers}" if pdm_layers else f"--method {method}"
            return None, (f"no trained {method} drafter for n={n}"
                          f"{f', L_s={pdm_layers}' if pdm_layers else ''}: train one "
                          f"with `python -m spd train --stages {n} {what} --out DIR` and "
                          "pass --checkpoint-dir")
        return SPDEngine(target, n_stages=n, split=layout.split, anchors=list(layout.anchors),
                         pdm=path, lookup=lookup, **engine_options), str(path)
    return build


def _adjusted_pp(c: Costs, n, s, draft_s, steps, greedy):
    return c.forward_s / max(c.forward_s, sum(c.stage_s[str(n)]) + c.head_s)


def _adjusted_spd(c: Costs, n, s, draft_s, steps, greedy):
    # Greedy: the last stage judges after its layers, the draft rank only drafts. Sampling: the
    # draft rank drafts and judges (head and rejection sampling); the stages run layers only.
    rank0 = draft_s + (0.0 if greedy else c.head_s)
    return s / n * c.forward_s / c.cycle(n, c.slowest_stage(n, head_on_last=greedy), rank0)


def _adjusted_spd_nd(c: Costs, n, s, draft_s, steps, greedy):
    # n devices: stage 0's device also drafts (and judges under sampling); the split is
    # rebalanced so that stage 0 holds fewer layers
    rank0 = draft_s + (0.0 if greedy else c.head_s)
    cycle = c.balanced_cycle(n, c.head_s if greedy else 0.0, {0: rank0})
    return s / n * c.forward_s / c.cycle(n, cycle)


TREE_WIDTH = 4  # the grid's tree row: the width the tree goal is set at (docs/tree.md)


def _adjusted_spd_tree(c: Costs, n, s, draft_s, steps, greedy):
    # W rows per stage step: each stage's one-row time scaled by what W rows cost here (a GPU
    # reads the same weights for them; a CPU computes W times over); the head judges one row
    # (a grid that did not time the chunk: charged W times one row, the CPU's worst case)
    chunk = c.chunk_s.get(str(TREE_WIDTH))
    rows = TREE_WIDTH if chunk is None else max(1.0, chunk / c.forward_s)
    per = [t * rows for t in c.stage_s[str(n)]]
    if greedy:
        per[-1] += c.head_s
    rank0 = draft_s + (0.0 if greedy else c.head_s)
    return s / n * c.forward_s / c.cycle(n, max(per), rank0)


def _adjusted_ppsd(c: Costs, n, s, draft_s, steps, greedy):
    # PPSD drafts after each step (on the critical path) and its last stage verifies
    return s / n * c.forward_s / c.cycle(n, c.slowest_stage(n, head_on_last=True) + draft_s)


def _adjusted_eagle(c: Costs, n, s, draft_s, steps, greedy):
    # a round: `steps` chained drafts, then one verification chunk of steps + 1 tokens
    return s * c.forward_s / (steps * draft_s + max(c.forward_s, c.chunk_s[str(steps + 1)]))


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("ar", staged=False, per_depth=False, measured_for_real=True, devices=lambda n: 1,
           adjusted=lambda *a: 1.0, build=_build_plain, is_reference=True,
           batched=lambda c, n, b, s, d, g: batch_rows.ar_tok_s(c, b)),
    Method("pp", staged=True, per_depth=False, measured_for_real=False, devices=lambda n: n,
           adjusted=_adjusted_pp, build=_build_plain, derived_from_reference=True,
           batched=lambda c, n, b, s, d, g: batch_rows.pp_tok_s(c, n, b)),
    Method(EAGLE3, staged=False, per_depth=False, measured_for_real=True,
           devices=lambda n: 1, adjusted=_adjusted_eagle, build=_build_eagle,
           cost_chunks=lambda decoder: [decoder.draft_steps + 1]),
    Method(ppsd.NAME, staged=True, per_depth=False, measured_for_real=False, devices=lambda n: n,
           adjusted=_adjusted_ppsd, build=_pdm_builder(ppsd.NAME, ppsd.layout)),
    Method("spd", staged=True, per_depth=True, measured_for_real=False,
           devices=lambda n: n + 1, adjusted=_adjusted_spd,
           build=_pdm_builder("spd", DepthLayout.build), batched=batch_rows.spd_tok_s),
    Method("spd-nd", staged=True, per_depth=True, measured_for_real=False,
           devices=lambda n: n, adjusted=_adjusted_spd_nd,
           build=_pdm_builder("spd", DepthLayout.build)),
    Method("spd-tree", staged=True, per_depth=True, measured_for_real=False,
           devices=lambda n: n + 1, adjusted=_adjusted_spd_tree,
           build=_pdm_builder("spd", DepthLayout.build, tree_width=TREE_WIDTH),
           cost_chunks=lambda decoder: [TREE_WIDTH]),
)}
NAMES = tuple(METHODS)


def get(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise SPDError(f"unknown method {name!r}: choose from {', '.join(NAMES)}") from None


def reference() -> Method:
    """The method every greedy output and measured ratio is compared with (AR)."""
    return next(m for m in METHODS.values() if m.is_reference)


def adjusted_speedup(method: str, costs: Costs, *, n: int = 1, s_theory: float = 1.0,
                     draft_s: float = 0.0, draft_steps: int = 0, greedy: bool = True) -> float:
    """Draft-cost-adjusted speedup over AR on one device (the terms above); `greedy`: where
    verification runs depends on it."""
    return get(method).adjusted(costs, n, s_theory, draft_s, draft_steps, greedy)


def devices_used(method: str, n: int) -> int:
    """Devices each method occupies: SPD adds a draft rank to its n stage ranks (SPD-nd drafts
    on stage 0's device); PPSD drafts on its first stage's device; PP uses the n stage ranks;
    AR and EAGLE-3 one device."""
    return get(method).devices(n)


def checkpoint_search(extra_dirs) -> list[Path]:
    """Folders searched for drafters: the shipped checkpoints, then `extra_dirs`."""
    return [SHIPPED_DIR, *map(Path, extra_dirs)]


__all__ = ["METHODS", "Method", "NAMES", "adjusted_speedup", "checkpoint_search",
           "devices_used", "get", "reference"]
