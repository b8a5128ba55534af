"""The SPD engine (single process): prefill, then the cycle (spd.runtime.cycle) with every stage
in this process, each on a CUDA stream of its own (`LocalStages`).

Stages share one device here, so this engine proves the algorithm and its accounting rather than
the wall-clock gain; the distributed runtime runs the same cycle with one rank per stage. An
autoregressive path (`generate_ar`) uses the same stages and caches.
"""
from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from spd import env
from spd.draft.drafters import PDMDrafter
from spd.draft.lookup import DEFAULT_MIN_LEN as DEFAULT_LOOKUP
from spd.draft.pdm import (
    PipelineDraftModule,
    check_compatible,
    check_draft_weights,
    find_shipped_pdm,
    read_pdm_config,
)
from spd.errors import SPDError
from spd.model.partition import DepthLayout
from spd.model.prompt import encode_request_prompt, is_prompt_batch
from spd.model.target import Stage, TargetModel
from spd.runtime.ar_decode import ARDecoder
from spd.runtime.batch_ar import BatchedAR
from spd.runtime.batch_pipeline import BatchedPipeline
from spd.runtime.batch_spd import BatchedSPD
from spd.runtime.cycle import DEFAULT_AHEAD, Cycle
from spd.runtime.driver import peek
from spd.runtime.request import check_prompt
from spd.runtime.sequence import Sequence, check_tree_width
from spd.runtime.slots import batch_request
from spd.runtime.stopping import StopRule
from spd.runtime.streaming import TextStream
from spd.runtime.types import DecodeStats, GenerationResult, PhaseTimer, SamplingParams
from spd.runtime.unit import LIVE, StageStep, UnitFormat
from spd.runtime.verdict import pick


class SPDEngine:
    """Speculative pipeline decoding of one sequence on a target cut into n stages.

    pdm: a PipelineDraftModule, a checkpoint folder, "untrained", or None for the checkpoint
    shipped for this target and layout (an untrained PDM if there is none: exact output, many
    rejections, and a warning says so). lookup: shortest context match the drafter uses in
    place of the PDM's guess (spd.draft.lookup; 0: the PDM alone); `engine.drafter.lookup` changes it.
    draft_weights: what the draft step reads, "model" (the PDM's own dtype), "int8" or "fp8"
    (weight-only quantised copies, spd_kernels.quant: half the weight bytes of bf16; the output
    is unchanged, only the acceptance may move); None leaves a given PDM as it is ("model" for
    one the engine loads).
    tree_width: candidate rows per position (1: a chain; spd.runtime.drafting). ahead: cycles
    launched past the one the host has read (spd.runtime.cycle).
    """

    def __init__(self, target: TargetModel, n_stages: int = 4, split=None, anchors=None,
                 pdm=None, pdm_layers: int | None = None, debug_poison: bool = False,
                 warn_untrained: bool = True, lookup: int = DEFAULT_LOOKUP,
                 draft_weights: str | None = None, tree_width: int = 1,
                 ahead: int = DEFAULT_AHEAD):
        if draft_weights is not None:  # a bad value fails before anything loads
            check_draft_weights(draft_weights)
        self.tree_width = check_tree_width(tree_width)
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
            raise SPDError(f"ahead is a number of cycles >= 0, got {ahead!r}")
        self.ahead = ahead
        if tree_width > 1 and target.hybrid:
            raise SPDError("tree drafting (tree width > 1) is not supported on hybrid targets: "
                           "their linear-attention layers keep one recurrent state per stage, "
                           "not one per branch; use tree width 1")
        self.target = target
        if isinstance(pdm, (str, Path)) and str(pdm) != "untrained" and anchors is None:
            # A checkpoint fixes its own anchors (a PPSD drafter's differ from the default)
            anchors = read_pdm_config(pdm).anchors
        self.layout = DepthLayout.build(target.num_layers, n_stages, split, anchors)
        self.n = self.layout.n
        self.debug_poison = debug_poison
        self._stages: list[Stage] = []
        self._ar: ARDecoder | None = None
        self._batches: dict = {}  # several prompts' decode by mode (their slot caches)
        self.pdm = None
        self.pdm_source = "none"
        if self.n >= 2:
            if pdm is None:  # the checkpoint shipped for this target and layout, if any
                pdm = find_shipped_pdm(target, self.layout) or "untrained"
            if isinstance(pdm, str) and pdm == "untrained":
                if warn_untrained:
                    warnings.warn("no trained PDM for this target and n: using an untrained one "
                                  "(output stays exact, decoding is slower)", stacklevel=2)
                pdm = PipelineDraftModule.untrained(target, self.layout, pdm_layers)
                self.pdm_source = "untrained"
            elif not isinstance(pdm, PipelineDraftModule):
                self.pdm_source = str(pdm)
                pdm = PipelineDraftModule.load(pdm, target, self.layout)
            else:
                check_compatible(pdm.config, target, self.layout)
                self.pdm_source = "given"
            if draft_weights is not None:
                pdm.quantize_(draft_weights)
            self.pdm = pdm
            self.drafter = PDMDrafter(pdm, lookup=lookup)

    # --- set-up -------------------------------------------------------------------------------
    def _prepare_stages(self, capacity: int, n: int) -> list[Stage]:
        layout = self.layout if n == self.n else DepthLayout.build(
            self.target.num_layers, n, None, self.layout.anchors)
        reuse = (len(self._stages) == n and self._stages[0].cache.capacity >= capacity
                 and [s.layer_ids for s in self._stages] == list(layout.stages))
        if not reuse:
            # max_rollback: stage s drops at most n - 1 - s rows (hybrid targets' state rings)
            self._stages = [Stage(self.target, i, r, capacity, self.debug_poison,
                                  max_rollback=n) for i, r in enumerate(layout.stages)]
        for s in self._stages:
            s.cache.truncate(0)
        return self._stages

    def _prefill(self, stages, ids, seq: Sequence | None = None, start: int = 0) -> torch.Tensor:
        """The prompt (or its chunk at positions start..) through every stage as one chunk ->
        the last stage's output [P, d]; with `seq`, each stage's anchor rows are kept there
        (the embedding is anchor 0)."""
        h = self.target.embed_tokens(ids)
        if seq is not None:
            seq.anchors[0, start:start + h.shape[0]] = h
        for s, st in enumerate(stages):
            outs, _ = st.run(h, start)
            if seq is not None:
                first = st.layer_ids.start
                seq.keep_anchors(s, start, [outs[b - first - 1]
                                            for _, b in self.layout.anchors_of_stage(s)])
            h = outs[-1]
        return h

    # --- autoregressive path ------------------------------------------------------------------
    def prepare_request(self, prompt, max_new_tokens, stop, stop_token_ids):
        """A request's checked form, as every decode path of this engine (and the distributed
        one's rank 0) starts: (prompt ids [T] int64, max new tokens, StopRule). `prompt`: token
        ids, text (encoded as it is) or chat messages (the chat template applied);
        `max_new_tokens` is capped to the context left (with a warning); `stop` (strings) and
        `stop_token_ids` end the decode as EOS does. Bad input raises SPDError."""
        t = self.target
        ids, max_new = check_prompt(t, encode_request_prompt(t.tokenizer, prompt),
                                    max_new_tokens)
        rule = StopRule(t.eos_token_ids, stop_token_ids, stop, t.tokenizer, t.vocab_size)
        return ids, max_new, rule

    @staticmethod
    def build_result(out: list[int], stats: DecodeStats, rule: StopRule) -> GenerationResult:
        """The GenerationResult of a finished decode: the new tokens `out`, its stats, and from
        `rule` (prepare_request's, having seen every token) the finish reason and the text."""
        # the text where the tokenizer can decode (tests give some targets a stand-in one)
        text = rule.text() if hasattr(rule.tokenizer, "decode") else None
        return GenerationResult(out, stats, rule.finish_reason, text)

    @torch.no_grad()
    def generate_ar(self, prompt_ids, max_new_tokens: int = 64,
                    sampling: SamplingParams = SamplingParams(),
                    on_token: Callable[[int], None] | None = None, *, stop=None,
                    stop_token_ids=None, max_batch: int | None = None):
        """Plain decoding through the same stages: one full forward per token (on a GPU one CUDA
        graph per token: spd.runtime.ar_decode). Takes what `generate` takes.

        Several prompts (a list of texts, of token-id lists or of chats) decode together with
        continuous batching, up to `max_batch` at once (default: all of them, at most 8), each
        with `sampling` (one for all, or a list of one each) and its own generator: a list of
        results, one each, in order (spd.runtime.batch_ar). on_token(i, id) then names the
        prompt."""
        if is_prompt_batch(prompt_ids):
            return self._generate_batch("ar", prompt_ids, max_new_tokens, sampling, on_token,
                                        stop, stop_token_ids, max_batch)
        if max_batch is not None:
            raise SPDError("max_batch applies to several prompts; this is one")
        ids, max_new, rule = self.prepare_request(prompt_ids, max_new_tokens, stop, stop_token_ids)
        t = self.target
        stages = self._prepare_stages(ids.numel() + max_new + 1, self.n)
        stats = DecodeStats(mode="ar", n=1)
        timer = PhaseTimer(stats.phase_s)
        gen = torch.Generator(t.device).manual_seed(sampling.seed)  # (Sequence's too)
        t0 = time.perf_counter()
        h = self._prefill(stages, ids)
        token = pick(t.logits(h[-1:])[0], sampling, gen)
        stats.prefill_s = time.perf_counter() - t0
        rule.feed(token)
        if on_token:
            on_token(token)
        t0 = time.perf_counter()
        if self._ar is None or self._ar.stages is not stages:
            self._ar = ARDecoder(t, stages)  # its graphs live as long as these stages
        out = self._ar.decode(token, ids.numel(), max_new, sampling, gen, rule, on_token, timer)
        stats.K = stats.N = len(out) - 1
        stats.decode_s = time.perf_counter() - t0
        stats.new_tokens = len(out)
        return self.build_result(out, stats, rule)

    @torch.no_grad()
    def generate_pipeline(self, prompt_ids, max_new_tokens: int = 64,
                          sampling: SamplingParams = SamplingParams(),
                          on_token: Callable[[int], None] | None = None, *, stop=None,
                          stop_token_ids=None, max_batch: int | None = None):
        """The pipeline without speculation on the engine's n stages (spd.runtime.batch_pipeline:
        one token per sequence every n cycles; several prompts keep the stages busy with each
        other). Takes what `generate_ar` takes and gives what it gives: the same tokens."""
        if is_prompt_batch(prompt_ids):
            return self._generate_batch("pipeline", prompt_ids, max_new_tokens, sampling,
                                        on_token, stop, stop_token_ids, max_batch)
        if max_batch is not None:
            raise SPDError("max_batch applies to several prompts; this is one")
        tick = None if on_token is None else (lambda _i, tok: on_token(tok))
        return self._generate_batch("pipeline", [prompt_ids], max_new_tokens, sampling, tick,
                                    stop, stop_token_ids, 1)[0]

    def _generate_batch(self, mode, prompts, max_new_tokens, sampling, on_token, stop,
                        stop_token_ids, max_batch) -> list[GenerationResult]:
        """Several prompts, continuously batched: mode "ar" (BatchedAR), "spd" (BatchedSPD) or
        "pipeline" (BatchedPipeline). An error (one from on_token too) frees every slot."""
        prompts, sampling, max_batch = batch_request(prompts, sampling, max_batch)
        requests = [self.prepare_request(p, max_new_tokens, stop, stop_token_ids)
                    for p in prompts]
        kind = {"ar": BatchedAR, "spd": BatchedSPD, "pipeline": BatchedPipeline}[mode]
        width = (self.tree_width,) if mode == "spd" else ()  # (a tree's rows in flight)
        context = max(kind.rows_needed(ids.numel(), max_new, self.n, *width)
                      for ids, max_new, _ in requests)
        batch = self._batches.get(mode)
        if batch is None or batch.slots < max_batch or batch.context < context:
            self._batches.pop(mode, None)  # (its caches freed before the new ones are made)
            batch = self._batches[mode] = kind(self.target if mode == "ar" else self,
                                               max_batch, context)
        waiting, joined = list(range(len(prompts))), {}
        try:
            while waiting or batch.running:
                while waiting and len(batch.running) < max_batch:
                    i = waiting.pop(0)
                    ids, max_new, rule = requests[i]
                    tick = None if on_token is None else (lambda tok, i=i: on_token(i, tok))
                    joined[i] = batch.join(ids, max_new, sampling[i], rule, tick)
                batch.step()
        finally:  # (an error: the next call finds every slot free)
            for entry in list(batch.running.values()):
                batch.leave(entry)
        return [self.build_result(joined[i].out, joined[i].stats, requests[i][2])
                for i in range(len(prompts))]

    def stream(self, prompt, max_new_tokens: int = 64,
               sampling: SamplingParams = SamplingParams(), *, stop=None, stop_token_ids=None,
               mode: str = "spd") -> TextStream:
        """`generate` (mode "spd") or `generate_ar` ("ar") as an iterator of TextPiece(token_id,
        text); `stream.result` holds the GenerationResult afterwards. Breaking out of the loop
        stops the decode."""
        if mode not in ("spd", "ar"):
            raise SPDError(f"mode must be 'spd' or 'ar', got {mode!r}")
        run = self.generate if mode == "spd" else self.generate_ar
        rule = StopRule(stop=stop, tokenizer=self.target.tokenizer)  # checks stop up front
        return TextStream(lambda on_token: run(prompt, max_new_tokens, sampling,
                                               on_token=on_token, stop=stop,
                                               stop_token_ids=stop_token_ids),
                          self.target.tokenizer, rule.stop_strings)

    # --- speculative pipeline decoding --------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int = 64,
                 sampling: SamplingParams = SamplingParams(), drafter=None,
                 on_token: Callable[[int], None] | None = None, *, stop=None,
                 stop_token_ids=None, max_batch: int | None = None):
        """Decode one sequence. prompt_ids: token ids (a list of ints, a 1-D or [1, L] integer
        tensor), text (tokenized as it is) or chat messages ([{"role": ..., "content": ...}],
        the chat template applied). on_token(id) is called with each new
        token as it is committed. stop: a string or strings that end the decode where they
        appear in the text (cut from `result.text`); stop_token_ids: ids that end it like EOS.
        `result.finish_reason` is "stop" or "length".

        Several prompts (a list of texts, of token-id lists or of chats) go through the pipeline
        together, up to `max_batch` at once (default: all, at most 8), each with its own
        speculation (spd.runtime.batch_spd: token chains on dense targets so far): a list of
        results, one each, in order, with `sampling` and on_token as generate_ar takes them."""
        if is_prompt_batch(prompt_ids):
            if drafter is not None:
                raise SPDError("several prompts decode with the engine's own drafter: give no "
                               "drafter")
            mode = "spd" if self.n >= 2 else "ar"
            return self._generate_batch(mode, prompt_ids, max_new_tokens, sampling, on_token,
                                        stop, stop_token_ids, max_batch)
        if max_batch is not None:
            raise SPDError("max_batch applies to several prompts; this is one")
        if self.n < 2:
            return self.generate_ar(prompt_ids, max_new_tokens, sampling, on_token, stop=stop,
                                    stop_token_ids=stop_token_ids)
        ids, max_new, rule = self.prepare_request(prompt_ids, max_new_tokens, stop, stop_token_ids)
        seq = Sequence(self.target, self.layout, drafter or self.drafter, ids, max_new, sampling,
                       DecodeStats(mode="spd", n=self.n), on_token, rule, self.tree_width)
        stages = self._prepare_stages(seq.buffer_rows, self.n)
        t0 = time.perf_counter()
        seq.start(self._prefill(stages, ids, seq)[-1:], t0)
        Cycle(seq, LocalStages(stages, seq), self.ahead).run()
        seq.finish()
        return self.build_result(seq.out, seq.stats, rule)


class LocalStages:
    """Every stage in this process, each on a CUDA stream of its own (Roles): the cycle's
    in-process transport. Stage s runs the unit the cycle holds for it (`Cycle.units[s]`) on
    the rows stage s - 1 made last cycle (`inbox[s]`, moved from `outbox[s - 1]` as the cycle
    begins), and its rows land where the unit's rows live (`Cycle.keep`). On a CPU, where
    reading is free, it skips a dead unit's stage step (`peek`); under SPD_REPLAY_CHECK it runs
    every unit, as a CUDA graph does."""

    lockstep = False  # no peers: the host stops launching once it has read the end
    replayable = capturable = True  # the whole cycle is one CUDA graph on a GPU
    messages = None

    def __init__(self, stages: list[Stage], seq: Sequence):
        t, n, W = seq.target, seq.n, seq.width
        fmt = UnitFormat(n, W)
        chain_greedy = seq.sampling.greedy and W == 1
        self.steps = [StageStep(st, seq.layout, fmt, chain_greedy and s == n - 1)
                      for s, st in enumerate(stages)]
        self.local = list(range(n))
        self.inbox = torch.zeros(n, W, t.hidden_size, device=t.device, dtype=t.dtype)
        self.outbox = torch.zeros_like(self.inbox)
        # the last stage's argmax (a greedy chain's verdict), kept where the cycle reads it
        self.verdict = torch.zeros(1, dtype=torch.int64, device=t.device)
        self.peek = seq.device.type == "cpu" and not env.replay_check_enabled()

    def begin(self, cycle: Cycle) -> None:
        self.inbox[1:].copy_(self.outbox[:-1])

    def run(self, cycle: Cycle) -> torch.Tensor:
        live = peek(cycle.units[:, LIVE]) if self.peek else None
        for s, step in enumerate(self.steps):
            head = cycle.units[s]
            if live is not None and not live[s]:
                step.skip(head)
                continue
            with cycle.roles.on(s + 1):
                anchors, out, token = step.run(head, None if s == 0 else self.inbox[s])
                self.outbox[s].copy_(out)
                cycle.keep(s, anchors, out)
                if token is not None:
                    self.verdict.copy_(token)
        return self.verdict
