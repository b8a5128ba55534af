"""The Gated DeltaNet step (spd_kernels.deltanet) at Qwen3.5-4B layer shapes (16 key / 32 value
heads of 128, conv over 8192 channels, kernel 4), for the rows a pipeline step runs (1 .. n+1),
against transformers' torch fallbacks for the same rows, and the state rings' memory per stage.

Rows, per backend that runs here:
  delta  gated_delta_step: ring slot read, T recurrent rows, per-row states written to the ring
  conv   conv_ring_step: history from the ring, causal conv + SiLU, histories written
  hf_delta / hf_conv  transformers' torch_recurrent_gated_delta_rule from one state (final state
         only) / causal_conv1d_update over the same rows: the cost without rollback
On the CPU the backends are the reference (the Triton kernels run there only in the interpreter,
which is not timed); on a GPU also triton.

    python benchmarks/bench_deltanet.py --threads 1            # CPU
    TRITON_INTERPRET=0 python benchmarks/bench_deltanet.py     # GPU
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import RESULTS, Table, add_device_args, device_setup, device_tag, run_meta, write_json  # noqa: E402

from spd_kernels.deltanet import conv_ring_step, gated_delta_step  # noqa: E402

HK, HV, DK, DV, K = 16, 32, 128, 128, 4  # Qwen3.5-4B's DeltaNet layer
C = 2 * HK * DK + HV * DV


def ring_memory() -> list[dict]:
    """MiB of the state rings per stage at Qwen3.5-4B (32 layers, 24 DeltaNet), ring n + 1,
    conv histories in bf16."""
    from transformers import Qwen3_5TextConfig

    from spd.model.hybrid import ring_bytes
    from spd.model.partition import partition_layers
    cfg = Qwen3_5TextConfig(hidden_size=2560, num_hidden_layers=32, linear_num_key_heads=HK,
                            linear_num_value_heads=HV, linear_key_head_dim=DK,
                            linear_value_head_dim=DV, linear_conv_kernel_dim=K)
    return [dict(n=n, ring=n + 1, mib_per_stage=[round(ring_bytes(cfg, r, n + 1) / 2 ** 20, 2)
                                                 for r in partition_layers(32, n)])
            for n in (2, 3, 4, 6)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_args(ap)
    ap.add_argument("--rows", default="1,3,5", help="rows per step (default 1,3,5)")
    args = ap.parse_args()
    device, dtype, timer = device_setup(args)
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        causal_conv1d_update,
        torch_recurrent_gated_delta_rule,
    )
    backends = ["reference"] + (["triton"] if device.type == "cuda" else [])
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)
    table = Table([("what", "<10"), ("backend", "<11"), ("rows", ">6"), ("us", ">12.1f"),
                   ("us_min", ">12.1f"), ("us_per_row", ">12.1f")])
    table.print_header()
    out = []
    for T in [int(x) for x in args.rows.split(",")]:
        R = max(T, 2)
        q, k, v = rnd(T, HK, DK), rnd(T, HK, DK), rnd(T, HV, DV)
        gate = -torch.rand(T, HV, generator=g).to(device)
        beta = torch.rand(T, HV, generator=g).to(device=device, dtype=dtype)
        ring = torch.randn(R, HV, DK, DV, generator=g).to(device)
        x, w, conv = rnd(T, C), rnd(C, K), rnd(R, K - 1, C)
        start = torch.tensor([7], device=device)
        cases = {}
        for b in backends:
            cases[("delta", b)] = lambda b=b: gated_delta_step(q, k, v, gate, beta, ring, start,
                                                               backend=b)
            cases[("conv", b)] = lambda b=b: conv_ring_step(x, conv, w, start, backend=b)
        state = ring[0].clone()[None]
        cases[("hf_delta", "torch")] = lambda: torch_recurrent_gated_delta_rule(
            q[None], k[None], v[None], g=gate[None], beta=beta[None], initial_state=state,
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        hist = conv[0].t().contiguous()[None]
        cases[("hf_conv", "torch")] = lambda: causal_conv1d_update(x.t()[None], hist, w,
                                                                   None, "silu")
        for (what, b), fn in cases.items():
            us, us_min = timer(fn)  # median and min: the CPU may be shared
            row = dict(what=what, backend=b, rows=T, us=us, us_min=us_min, us_per_row=us / T)
            table.print(row)
            out.append(row)
    mem = ring_memory()
    for m in mem:
        print(f"ring memory at Qwen3.5-4B, n={m['n']} (ring {m['ring']}): "
              f"{m['mib_per_stage']} MiB per stage")
    path = args.json_out or RESULTS / f"{args.date}-deltanet-{device_tag(device)}.json"
    write_json(path, run_meta(device, dtype=str(dtype), shapes=dict(HK=HK, HV=HV, DK=DK, DV=DV,
                                                                   K=K, C=C)),
               rows=out, ring_memory=mem)


if __name__ == "__main__":
    main()
