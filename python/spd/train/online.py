"""Online distillation: a PDM trained on the target's features computed step by step.

The run, on every rank alike (spd.train.ranks):
1. optionally regenerate the data's answers with the target (spd.train.regenerate), each rank
   its share, into `out/regenerated/`; from then on those files are the data;
2. one pass over the data (tokenising only): how many sequences and tokens it holds, what was
   dropped and why, the token frequencies that choose the draft vocabulary (unless it comes
   from --init-from), and a hash of every token (a resumed run must see the same data);
3. train (spd.train.trainer.fit) on micro-batches whose features the frozen target computes now
   (spd.train.batches.OnlineBatches); the held-out split's first sequences are evaluated.
"""
from __future__ import annotations

import hashlib
import json
import math
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from spd.errors import SPDError
from spd.train.batches import OnlineBatches
from spd.train.corpus import (
    MIN_FOR_PINNED,
    AnswerMask,
    Corpus,
    CorpusConfig,
    CorpusStats,
    encode_conversation,
)
from spd.train.teacher import Teacher
from spd.train.trainer import TrainConfig, build_draft_vocab, fill_sampler, fit

REGENERATED = "regenerated"


def regenerated_sources(target, corpus_cfg: CorpusConfig, out: Path, group, *,
                        max_new_tokens: int, batch_size: int, dtype=None,
                        progress: bool = True) -> list[str]:
    """Regenerate every conversation's first answer (evaluation prompts excluded), rank by rank;
    returns the files that replace the sources (every rank's)."""
    from spd.data.conversations import read_conversations
    from spd.data.datasets import contains_eval_prompt, eval_prompt_keys
    from spd.train.regenerate import regenerate
    keys = eval_prompt_keys() if corpus_cfg.exclude_eval else set()
    convs = (c for c in read_conversations(corpus_cfg.sources)
             if not (keys and contains_eval_prompt(c, keys)))
    folder = out / REGENERATED
    regenerate(target, convs, folder / f"rank{group.rank:03d}-of-{group.world:03d}.jsonl",
               max_new_tokens=max_new_tokens, batch_size=batch_size, dtype=dtype,
               rank=group.rank, world=group.world, progress=progress and group.main)
    group.sum_floats([0.0], "the end of regeneration")  # every rank's file is complete
    return [str(folder / f"rank{r:03d}-of-{group.world:03d}.jsonl") for r in range(group.world)]


def survey(corpus: Corpus, vocab_size: int) -> tuple[CorpusStats, torch.Tensor, str]:
    """One pass: the stats, token frequencies over the whole target vocabulary and a sha256 of
    every training sequence (order and boundaries included)."""
    stats = CorpusStats()
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    h = hashlib.sha256()
    for ids in corpus.epoch(0, stats):
        t = torch.tensor(ids, dtype=torch.int64)
        if int(t.max()) >= vocab_size or int(t.min()) < 0:
            raise SPDError(f"the tokenizer gave token id {int(t.max())} outside the target's "
                           f"vocabulary of {vocab_size}: is the tokenizer the target's?")
        counts += torch.bincount(t, minlength=vocab_size)
        h.update(len(ids).to_bytes(4, "little"))
        h.update(t.to(torch.int32).numpy().tobytes())
    if stats.sequences == 0:
        raise SPDError(f"no training sequence in {', '.join(corpus.cfg.sources)}: "
                       f"{stats.summary()}")
    return stats, counts, h.hexdigest()


def init_vocab(cfg: TrainConfig, counts: torch.Tensor) -> torch.Tensor:
    """The draft vocabulary: --init-from's (its head rows carry over) or the most frequent
    tokens of the data."""
    if cfg.init_from:
        from spd.draft.checkpoint import read_weights
        src = read_weights(cfg.init_from).get("draft_to_target")
        if src is not None:
            return src.to(torch.int64)
    return build_draft_vocab(counts, cfg.draft_vocab_size, cfg.draft_vocab_coverage)


def train_online(target, corpus_cfg: CorpusConfig, cfg: TrainConfig, out_dir, *, group=None,
                 epochs: float | None = None, regenerate_tokens: int = 0,
                 regenerate_batch: int = 16, regenerate_dtype=None, progress: bool = True,
                 storage: str = "int8", exclude_keys: set[str] | None = None) -> dict:
    """Train a PDM online on `corpus_cfg`'s data; cfg.steps is set from `epochs` (passes over
    the data) when given. Writes the checkpoint to out_dir, returns the run's summary."""
    from spd.train.ranks import RankGroup
    group = group or RankGroup()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if regenerate_tokens:
        sources = regenerated_sources(target, corpus_cfg, out, group,
                                      max_new_tokens=regenerate_tokens,
                                      batch_size=regenerate_batch, dtype=regenerate_dtype,
                                      progress=progress)
        corpus_cfg = replace(corpus_cfg, sources=sources)
    tok = target.tokenizer
    corpus = Corpus(corpus_cfg, lambda conv: encode_conversation(tok, conv), exclude_keys)
    mask_of = AnswerMask(tok, target.eos_token_ids) if cfg.loss_on == "answers" else None
    stats, counts, data_id = survey(corpus, target.vocab_size)
    if corpus.pin_holdout(stats):  # a small set: one conversation held out, count again
        stats, counts, data_id = survey(corpus, target.vocab_size)
    if epochs is not None:
        if not epochs > 0:
            raise SPDError(f"--epochs must be > 0, got {epochs}")
        cfg.steps = max(1, math.ceil(epochs * stats.sequences / cfg.batch_sequences))
    if progress and group.main:
        print(f"[spd train] data: {stats.summary()}", flush=True)
        print(f"[spd train] {cfg.steps} steps of {cfg.batch_sequences} sequences "
              f"({cfg.steps * cfg.batch_sequences / stats.sequences:.2f} epochs) on "
              f"{group.world} rank(s)", flush=True)
    layout_anchors = cfg.anchors
    from spd.model.partition import DepthLayout
    layout = DepthLayout.build(target.num_layers, cfg.n_stages, cfg.split, layout_anchors)
    teacher = Teacher(target, list(layout.anchors), mask_of)
    held_seqs = corpus.held_out(cfg.eval_sequences) if group.main else []
    if group.main and not held_seqs:
        warnings.warn(
            f"no held-out conversation in {', '.join(corpus_cfg.sources)} (held-out share "
            f"{corpus_cfg.holdout}, {stats.sequences} usable; one is held out from "
            f"{MIN_FOR_PINNED} on): training on all of them, and no held-out acceptance will "
            "be reported", stacklevel=2)
    held_out = []
    for ids in held_seqs:  # the first crop_len tokens of each, as the cached path does
        held_out += teacher([ids[:cfg.crop_len] if cfg.crop_len > 0 else ids])
    vocab = init_vocab(cfg, counts)
    cfg.draft_vocab_size = int(vocab.numel())  # --init-from's size wins; record that one

    def batches(plan, rank, n):
        return OnlineBatches(corpus, teacher, plan, rank, cfg.crop_len, cfg.seed,
                             fill_sampler(n, cfg))
    last = fit(target, cfg, out, vocab=vocab, feature_anchors=list(layout.anchors),
               held_out=held_out, make_batches=batches, data_id=data_id,
               train_tokens=stats.tokens, progress=progress, storage=storage, group=group,
               extra={"data": {"sources": list(corpus_cfg.sources), **stats.as_dict()}})
    summary = {"out": str(out), "mode": "online", "steps": cfg.steps, "ranks": group.world,
               "data": stats.as_dict(), "peak_memory_per_rank": cfg.peak_memory, "final": last}
    if group.main:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


__all__ = ["REGENERATED", "init_vocab", "regenerated_sources", "survey", "train_online"]
