"""Distillation data: token sequences, and the frozen target's features for them, cached on disk.

Sequences are chat conversations with the target's chat template applied. With self-distillation
the assistant turn is the target's own greedy response to the user's first turn (the drafter must
predict what the target says, not what people said). Evaluation prompts are excluded.

Features are written in shards (`shard_00000.safetensors`), each holding for its tokens: the
anchor hidden states [m, N, d] (fp16), the final normed hidden state [N, d] (fp16, the target's
logits are lm_head of it, recomputed on the draft vocabulary at train time), the target's argmax
[N] and the token ids, plus sequence offsets. Extraction resumes from the last finished shard.
"""
from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import torch
from tqdm import tqdm

from spd.data.files import save_safetensors, write_text_atomic
from spd.errors import SPDError
from spd.model.target import Stage
from spd.train.corpus import encode_conversation
from spd.train.regenerate import generate_answers, prompt_ids

META = "meta.json"


# --- sequences --------------------------------------------------------------------------------
def _encode(tokenizer, conversation) -> list[int]:
    return encode_conversation(tokenizer, conversation)


def _prompt_ids(tokenizer, text) -> list[int]:
    return prompt_ids(tokenizer, [{"role": "user", "content": text}])


def self_distill(target, prompts: list[str], max_new_tokens: int, max_prompt: int = 256,
                 batch_size: int = 16, dtype: torch.dtype | None = None) -> list[list[int]]:
    """prompt + the target's greedy response, for each prompt (spd.train.regenerate: batched,
    left-padded; `dtype` generates with a copy of the target in that dtype, the features and
    logits trained on are still extracted at the target's own)."""
    encoded = [_prompt_ids(target.tokenizer, p)[-max_prompt:] for p in prompts]
    answers = generate_answers(target, encoded, max_new_tokens, batch_size, dtype)
    return [e + a for e, a in zip(encoded, answers)]


def cached_sequences(path, build) -> list[list[int]]:
    """Sequences from `path` if a previous run saved them there, else build() and save them
    (self-distillation is the slow part of data building: never do it twice)."""
    p = Path(path)
    if p.exists():
        return json.loads(p.read_text())
    seqs = build()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".partial")
    tmp.write_text(json.dumps(seqs))
    tmp.rename(p)
    return seqs


def build_sequences(target, *, conversations: int, self_distill_prompts: int, max_len: int,
                    response_tokens: int, seed: int = 0, exclude_eval: bool = True,
                    extra_conversations=None, skip: int = 0, batch_size: int = 16,
                    distill_dtype: torch.dtype | None = None,
                    code_prompts: int = 0, code_roots=()) -> list[list[int]]:
    """ShareGPT conversations (chat template applied, cut to max_len) and self-distilled ones,
    plus the target's answers to `code_prompts` code-completion prompts (standard-library
    functions, see `python_function_prompts`, then those of the package folders `code_roots`).

    Each pool is shuffled under `seed` and its first `skip` items are passed over, so a second
    data set built with skip >= what the first one took from every pool shares no prompt with
    it. The code pool is the shuffled standard-library prompts followed by the shuffled prompts
    of `code_roots`, so adding roots leaves the standard-library part (and what a skip passes
    over in it) as it was."""
    from spd.data.datasets import (
        contains_eval_prompt,
        eval_prompt_keys,
        humaneval_function_names,
        iter_sharegpt,
        python_function_prompts,
    )

    tok = target.tokenizer
    convs = []
    if self_distill_prompts or conversations:  # code prompts alone need no ShareGPT (~27 MB)
        # the order (and what --data-skip passes over) is that of the sets before heldout
        keys = eval_prompt_keys(("mt_bench", "humaneval")) if exclude_eval else set()
        convs = [c for c in iter_sharegpt() if not contains_eval_prompt(c, keys)]
        convs += list(extra_conversations or [])
    rng = random.Random(seed)
    rng.shuffle(convs)
    if exclude_eval and convs:
        held = eval_prompt_keys(("heldout",))
        convs = [c for c in convs if not contains_eval_prompt(c, held)]
    convs = convs[skip:]
    distill_src = convs[:self_distill_prompts]
    human_src = convs[self_distill_prompts:self_distill_prompts + conversations]
    prompts = [c[0]["content"] for c in distill_src]
    if code_prompts:
        names = humaneval_function_names() if exclude_eval else ()
        pool = python_function_prompts(exclude_names=names)
        random.Random(seed).shuffle(pool)
        more = [p for root in code_roots for p in python_function_prompts(root, names)]
        random.Random(seed).shuffle(more)
        pool += more
        if skip + code_prompts > len(pool):
            where = "the standard library" + (" and the code roots" if code_roots else "")
            raise SPDError(f"asked for {code_prompts} code prompts after skipping {skip}, but "
                           f"{where} give {len(pool)} in all; lower the count or the skip")
        prompts += pool[skip:skip + code_prompts]
    seqs = []
    if prompts:
        seqs += self_distill(target, prompts, response_tokens, batch_size=batch_size,
                             dtype=distill_dtype)
    for conv in tqdm(human_src, desc="tokenising conversations", unit="conv"):
        ids = _encode(tok, conv)[:max_len]
        if len(ids) >= 16:
            seqs.append(ids)
    return [s[:max_len] for s in seqs if len(s) >= 16]


# --- features ---------------------------------------------------------------------------------
@torch.no_grad()
def sequence_features(target, ids: list[int], anchors: list[int]):
    """(anchor states [m, T, d], final normed hidden [T, d], target argmax [T]) for one sequence."""
    t = target
    x = torch.tensor(ids, device=t.device)
    stage = Stage(t, 0, range(t.num_layers), capacity=len(ids))
    slot = {b: j for j, b in enumerate(anchors)}
    out = torch.empty(len(anchors), len(ids), t.hidden_size, device=t.device, dtype=t.dtype)

    def record(idx, h):
        if idx in slot:
            out[slot[idx]] = h

    h = t.embed_tokens(x)
    record(0, h)
    h = stage.forward(h, 0, record)
    final = t.norm(h)
    argmax = t.lm_head(final).argmax(-1)
    return out, final, argmax


def extract_features(target, sequences: list[list[int]], anchors: list[int], out_dir,
                     shard_tokens: int = 32768) -> Path:
    """Write feature shards for `sequences` into out_dir (resumable: finished shards are kept).

    The folder records what shaped it (target, anchors, and a hash of every token of the data),
    so features of other data are never reused: a mismatch is refused, naming the difference."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / META
    meta = {"target_fingerprint": target.fingerprint(), "anchors": list(anchors),
            "hidden_size": target.hidden_size, "num_layers": target.num_layers,
            "num_sequences": len(sequences), "data_sha256": data_hash(sequences), "shards": []}
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        keys = ("target_fingerprint", "anchors", "num_sequences", "data_sha256")
        differ = [k for k in keys if old.get(k) != meta[k]]
        if differ:
            raise SPDError(f"the features folder {out} holds features of another target, "
                           f"anchor set or data than this run's (differs: {', '.join(differ)}; "
                           f"other data options?): pass --features with a fresh folder, or "
                           f"delete {out}")
        meta = old
    # Group sequences into shards of about shard_tokens tokens, deterministically.
    groups, cur, size = [], [], 0
    for i, s in enumerate(sequences):
        cur.append(i)
        size += len(s)
        if size >= shard_tokens:
            groups.append(cur)
            cur, size = [], 0
    if cur:
        groups.append(cur)
    done = set(meta["shards"])
    bar = tqdm(total=sum(len(s) for s in sequences), desc="extracting features", unit="tok")
    for k, group in enumerate(groups):
        name = f"shard_{k:05d}.safetensors"
        n_tok = sum(len(sequences[i]) for i in group)
        if name in done and (out / name).exists():
            bar.update(n_tok)
            continue
        parts = [sequence_features(target, sequences[i], anchors) for i in group]
        offsets = torch.tensor([0] + [len(sequences[i]) for i in group]).cumsum(0)
        save_safetensors({
            "tokens": torch.tensor([t for i in group for t in sequences[i]], dtype=torch.int32),
            "offsets": offsets,
            "anchors": torch.cat([p[0] for p in parts], dim=1).half().contiguous(),
            "final": torch.cat([p[1] for p in parts]).half().contiguous(),
            "argmax": torch.cat([p[2] for p in parts]).int().contiguous(),
        }, out / name)
        meta["shards"].append(name)
        write_text_atomic(meta_path, json.dumps(meta, indent=1))
        bar.update(n_tok)
    bar.close()
    meta["complete"] = True
    write_text_atomic(meta_path, json.dumps(meta, indent=1))
    return out


def data_hash(sequences: list[list[int]]) -> str:
    """sha256 of every token id of the data, sequence boundaries included."""
    h = hashlib.sha256()
    for s in sequences:
        h.update(len(s).to_bytes(4, "little"))
        h.update(torch.tensor(s, dtype=torch.int32).numpy().tobytes())
    return h.hexdigest()


class FeatureSet:
    """All sequences of one or more features folders in memory: items[i] -> dict of tensors.

    Several folders (data sets extracted separately, e.g. a second self-distillation round) are
    concatenated in the order given; they must hold the same anchors of the same target."""

    def __init__(self, folders, target=None):
        from safetensors.torch import load_file

        folders = [Path(f) for f in ([folders] if isinstance(folders, (str, Path)) else folders)]
        if not folders:
            raise SPDError("no features folder given")
        self.items = []
        self.meta = None
        for folder in folders:
            if not (folder / META).exists():
                raise SPDError(f"{folder} has no {META}: extract features first (spd train "
                               "--features FOLDER extracts them when missing)")
            meta = json.loads((folder / META).read_text())
            if target is not None and meta["target_fingerprint"] != target.fingerprint():
                raise SPDError(f"features in {folder} were extracted from another target")
            if self.meta is not None and meta["anchors"] != self.meta["anchors"]:
                raise SPDError(f"features in {folder} hold anchors {meta['anchors']}, those in "
                               f"{folders[0]} {self.meta['anchors']}: extract them alike")
            self.meta = self.meta or meta
            for name in meta["shards"]:
                sh = load_file(str(folder / name))
                off = sh["offsets"].tolist()
                for a, b in zip(off, off[1:]):
                    self.items.append({k: (sh[k][:, a:b] if k == "anchors" else sh[k][a:b])
                                       for k in ("tokens", "anchors", "final", "argmax")})
        self.anchors = self.meta["anchors"]

    def __len__(self):
        return len(self.items)

    def data_id(self) -> str:
        """A hash of every token of every sequence, in order: which data a run trained on."""
        return data_hash([x["tokens"].tolist() for x in self.items])

    def token_count(self) -> int:
        return sum(len(x["tokens"]) for x in self.items)

    def argmax_counts(self, vocab_size: int) -> torch.Tensor:
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for x in self.items:
            counts += torch.bincount(x["argmax"].long(), minlength=vocab_size)
        return counts
