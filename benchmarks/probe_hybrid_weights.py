"""Bytes of weights each rank of a hybrid target (Qwen3.5 / Qwen3-Next) holds, for a tiny random
hybrid (measured, CPU) and for Qwen3.5-4B (from its config alone: nothing is loaded), with the
load's peak there.

Measured: every rank (rank 0: embedding, final norm, LM head; stage s: its layers, stage 0 the
embedding too, the last stage the norm and head) loads its part in a fresh process with
`load_target(layers=, embed=, head=)` and builds its stage's weights (`TargetModel.stage_weights`);
"held" is the bytes of the distinct storages of its parameters and stage weights ("params": of
its parameters alone). With --before DIR the same is measured with the code of that checkout
(its python/ first on PYTHONPATH). (The tiny model's resident peak is not shown: its weights,
~25 MB, are lost beside the imports' own growth.)

From the config (bf16): before this change a rank loaded the whole model (its peak) and, once
the rest was dropped, held its part plus the stage's copies: per gated-attention layer the
permuted q, the gate, k and v packed anew; per dense layer gate/up packed anew; per Qwen3-Next
DeltaNet layer its reordered q/k/v, z, b, a. Now it reads its part only, and the stage weights
are views of it.

    python benchmarks/probe_hybrid_weights.py --stages 2 --before /path/to/old/checkout
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MB = 1 << 20
# Qwen3.5-4B's text model as remembered from its published config.json (not checked against
# the file; no network here): 32 layers, every fourth full attention
QWEN35_4B = dict(vocab_size=248320, hidden_size=2560, intermediate_size=9216,
                 num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
                 head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                 linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                 tie_word_embeddings=True)

_RANK = """
import json, sys, torch
from spd.model.loading import load_target
folder, first, last, embed, head = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \\
    sys.argv[4] == "1", sys.argv[5] == "1"
t = load_target(folder, tokenizer=False, layers=range(first, last), embed=embed, head=head)
w = t.stage_weights(range(first, last))
tensors = [p for p in t.hf.parameters() if not p.is_meta]
for lw in w.layers:
    tensors += [x for x in (*vars(lw).values(), *vars(lw.mlp).values())
                if isinstance(x, torch.Tensor)]
held = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for x in tensors}
params = sum(p.nbytes for p in t.hf.parameters() if not p.is_meta)
print(json.dumps(dict(held=sum(held.values()), params=params)))
"""


def ranks(num_layers: int, n: int) -> list[tuple[str, int, int, bool, bool]]:
    from spd.model.partition import partition_layers
    out = [("rank 0", 0, 0, True, True)]
    for s, r in enumerate(partition_layers(num_layers, n)):
        out.append((f"stage {s}", r.start, r.stop, s == 0, s == n - 1))
    return out


def measure(folder: Path, n: int, checkout: Path) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=f"{checkout / 'python'}:{checkout}")
    out = []
    for name, first, last, embed, head in ranks(4, n):
        res = subprocess.run([sys.executable, "-c", _RANK, str(folder), str(first), str(last),
                              str(int(embed)), str(int(head))], env=env, capture_output=True,
                             text=True, timeout=600, check=True)
        out.append(dict(rank=name, **json.loads(res.stdout.strip().splitlines()[-1])))
    return out


def config_figures(n: int, dtype_bytes: int = 2) -> list[dict]:
    """Per rank at Qwen3.5-4B, bf16: bytes held before / after, and the load's peak before
    (the whole model, loaded before the rest was dropped; now the peak is the part)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(**QWEN35_4B)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    numel = lambda m: sum(p.numel() for p in m.parameters())
    whole = numel(model) * dtype_bytes
    embed = model.model.embed_tokens.weight.numel() * dtype_bytes
    norm_head = (numel(model.model.norm) + (0 if cfg.tie_word_embeddings
                                            else model.lm_head.weight.numel())) * dtype_bytes
    d, hd = cfg.hidden_size, cfg.head_dim
    out = []
    for name, first, last, has_embed, has_head in ranks(cfg.num_hidden_layers, n):
        part = sum(numel(model.model.layers[i]) for i in range(first, last)) * dtype_bytes
        if name == "rank 0" or has_embed or (has_head and cfg.tie_word_embeddings):
            part += embed
        if has_head:
            part += norm_head
        copies = 0
        for i in range(first, last):
            if cfg.layer_types[i] == "full_attention":  # q, gate, k, v packed anew
                copies += (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd * d
            copies += 2 * cfg.intermediate_size * d  # gate/up packed anew
        copies *= dtype_bytes
        out.append(dict(rank=name, layers=f"{first}..{last - 1}" if last > first else "-",
                        peak_before_mib=round(max(whole, part + copies) / MB),
                        held_before_mib=round((part + copies) / MB),
                        held_after_mib=round(part / MB),
                        saved_mib=round(copies / MB),
                        peak_saved_mib=round((max(whole, part + copies) - part) / MB)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--before", type=Path, help="a checkout to measure the same with")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "python"))
    from spd.model.loading import save_tiny_random_hybrid

    result = {"device": "CPU", "dtype": "float32 (tiny), bfloat16 (Qwen3.5-4B, config)",
              "stages": args.stages, "after": str(REPO),
              "before": str(args.before) if args.before else None, "tiny": {}, "qwen3_5_4b": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for mt in ("qwen3_5", "qwen3_next"):
            folder = save_tiny_random_hybrid(Path(tmp) / mt, mt, layer_types=[
                "full_attention", "linear_attention", "linear_attention", "full_attention"])
            for label, checkout in (("after", REPO), ("before", args.before)):
                if checkout is None:
                    continue
                rows = measure(folder, args.stages, checkout)
                result["tiny"].setdefault(mt, {})[label] = rows
                print(f"tiny {mt}, n={args.stages}, {label} ({checkout}):")
                for r in rows:
                    print(f"  {r['rank']:<8} held {r['held'] / 1024:9.1f} KiB  params "
                          f"{r['params'] / 1024:9.1f} KiB")
    for n in sorted({2, 4, args.stages}):
        rows = config_figures(n)
        result["qwen3_5_4b"][n] = rows
        print(f"Qwen3.5-4B (config, bf16), n={n}:")
        for r in rows:
            print(f"  {r['rank']:<8} layers {r['layers']:<6} peak before {r['peak_before_mib']:>6}"
                  f" MiB, held before {r['held_before_mib']:>6} MiB, after "
                  f"{r['held_after_mib']:>6} MiB (saved {r['saved_mib']} MiB held, "
                  f"{r['peak_saved_mib']} MiB peak)")
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
