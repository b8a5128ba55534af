"""Is drafting hidden? The draft rank's per-cycle work against one stage's forward (issue 4).

SPD hides drafting when the draft rank finishes its cycle no later than the slowest stage. This
times the runtime's own code paths (not kernel microbenchmarks) on a target of a given shape with
random weights, at a context of --context tokens already cached:

  stage   spd.model.target.Stage.forward of one row through the largest stage of the default split
          (ceil(L / n) layers), what every stage rank does each cycle;
  draft   spd.draft.drafters.PDMDrafter.draft at fill n: anchor projection of the n+1 staircase rows,
          the PDM's L_s layers over them, the draft LM head and argmax (draft vocabulary
          --draft-vocab, MLP width --pdm-intermediate, default the target's); on a GPU both
          eagerly and as the CUDA-graph replay the runtime uses there (spd.draft.graphs);
  verify  spd_kernels.verify_greedy with the target's final norm and LM head: norm + LM head +
          argmax + compare, as the last stage runs it after its layers. Where it runs depends on
          the sampling: greedy on a chain, the last stage judges each draft itself (its cycle
          is stage + verify, the drafter's the draft alone); otherwise rank 0 judges in its
          cycle (spd.runtime.cycle: draft + verify, and rejection sampling adds to the verify
          timed here).

Greedy, the draft is hidden when draft <= stage; under sampling when draft + verify <= stage
(the last column: "yes" for both, "draft only" for greedy alone).
Only the largest stage's layers and the LM head are built, so Qwen3-8B shapes fit a laptop.

    python benchmarks/bench_draft_hiding.py                                  # GPU: qwen3-4b, bf16
    python benchmarks/bench_draft_hiding.py --device cpu --dtype fp32 --iters 3 --context 256
    python benchmarks/bench_draft_hiding.py --model smollm2-135m --stages 2,4,6 --pdm-layers 1,2

Prints a table and writes JSON (default benchmarks/results/<date>-draft-hiding-<device>.json).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_kernels import MODELS  # noqa: E402
from harness import (  # noqa: E402
    RESULTS,
    add_device_args,
    device_setup,
    device_tag,
    run_meta,
    write_json,
)

from spd.draft.drafters import PDMDrafter  # noqa: E402
from spd.draft.pdm import PDMConfig, PipelineDraftModule  # noqa: E402
from spd.model.loading import describe_device  # noqa: E402
from spd.model.partition import DepthLayout  # noqa: E402
from spd.model.target import Stage, TargetModel  # noqa: E402
from spd.runtime.types import SamplingParams  # noqa: E402
from spd_kernels import verify_greedy  # noqa: E402


def stage_target(shape, layers: int, device, dtype) -> TargetModel:
    """A random target holding `layers` decoder layers of `shape` (plus embedding, final norm and
    a tied LM head at the full vocabulary): enough to run its largest stage and the verifier."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = Qwen3Config(vocab_size=shape.vocab, hidden_size=shape.hidden,
                      intermediate_size=shape.intermediate, num_hidden_layers=layers,
                      num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                      head_dim=shape.head_dim, tie_word_embeddings=True,
                      max_position_embeddings=32768)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(dtype).eval()
    return TargetModel(model, None, name=f"{shape.name}-shaped random")


def random_pdm(shape, layout: DepthLayout, pdm_layers: int, draft_vocab: int,
               intermediate: int | None, device, dtype):
    cfg = PDMConfig(target_fingerprint="random", target_num_layers=shape.layers,
                    target_hidden_size=shape.hidden, target_vocab_size=shape.vocab,
                    n_stages=layout.n, stage_split=layout.split, anchors=list(layout.anchors),
                    num_layers=pdm_layers, hidden_size=shape.hidden, num_heads=shape.heads,
                    num_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                    intermediate_size=intermediate or shape.intermediate,
                    draft_vocab_size=draft_vocab,
                    rope_theta=1e6)
    torch.manual_seed(1)
    with torch.device(device):
        pdm = PipelineDraftModule(cfg)
    with torch.no_grad():
        for p in pdm.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    return pdm.to(dtype).eval()


def measure(args, shape, n: int, pdm_layers: list[int], device, dtype, timer) -> list[dict]:
    layout = DepthLayout.build(shape.layers, n)
    stage_layers = max(layout.split)
    target = stage_target(shape, stage_layers, device, dtype)
    C, d = args.context, shape.hidden
    cap = C + n + 8

    stage = Stage(target, 0, range(stage_layers), cap)
    stage.cache.reserve(0, C)  # C cached rows (their values do not change the cost)
    h = torch.randn(1, d, device=device, dtype=dtype)

    def stage_fwd():
        stage.cache.truncate(C)
        stage.forward(h, C)

    stage_us, _ = timer(stage_fwd)

    greedy = SamplingParams()
    draft_tok = torch.zeros(1, dtype=torch.int64, device=device)
    verify_us, _ = timer(lambda: verify_greedy(h, target.norm.weight, target.rms_eps,
                                               target.lm_head.weight, draft_tok,
                                               target.norm_offset))

    types_of_depth = [layout.agg_type(k) for k in range(n + 1)]
    # Steady state at fill n: rows [C - n, C] hold depths n, n-1, ..., 0.
    types = torch.tensor([types_of_depth[n - i] for i in range(n + 1)], device=device)
    anchors = torch.randn(len(layout.anchors), n + 1, d, device=device, dtype=dtype)
    # the window's first position and the drafted one, on the device as the cycle passes them
    start = torch.tensor([C - n], device=device)
    position = torch.tensor(C + 1, device=device)
    rows = []
    modes = [("eager", False)] + ([("graph", True)] if device.type == "cuda" else [])
    for ls, width in [(ls, w) for ls in pdm_layers for w in args.widths]:
        pdm = random_pdm(shape, layout, ls, args.draft_vocab, width, device, dtype)
        for mode, graphs in modes:
            drafter = PDMDrafter(pdm, cuda_graphs=graphs)
            drafter.begin(cap, shape.vocab)
            drafter.cache.reserve(0, C - n)
            draft_us, _ = timer(lambda: drafter.draft(anchors, types, start, position, greedy,
                                                      None))
            if graphs and (drafter.graphs is None or drafter.graphs.failed):
                mode = "eager (graph capture failed)"
            rank0 = draft_us + verify_us
            rows.append(dict(model=shape.name, n=n, pdm_layers=ls, draft_mode=mode,
                             pdm_intermediate=pdm.config.intermediate_size,
                             stage_layers=stage_layers, split=layout.split, context=C,
                             stage_us=stage_us, draft_us=draft_us, verify_us=verify_us,
                             draft_rank_us=rank0, draft_over_stage=draft_us / stage_us,
                             rank0_over_stage=rank0 / stage_us, draft_hidden=draft_us <= stage_us,
                             rank0_hidden=rank0 <= stage_us))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-4b", choices=sorted(MODELS))
    ap.add_argument("--stages", default="4,8", help="comma-separated n")
    ap.add_argument("--pdm-layers", default="2,3", help="comma-separated L_s")
    ap.add_argument("--draft-vocab", type=int, default=32768)
    ap.add_argument("--pdm-intermediate", default=None,
                    help="comma-separated MLP widths of the PDM (default: the target's)")
    ap.add_argument("--context", type=int, default=1024, help="tokens already in the caches")
    add_device_args(ap)
    args = ap.parse_args()
    device, dtype, timer = device_setup(args)
    try:
        stages = [int(x) for x in args.stages.split(",")]
        pdm_layers = [int(x) for x in args.pdm_layers.split(",")]
    except ValueError:
        sys.exit(f"--stages and --pdm-layers take comma-separated integers, got "
                 f"{args.stages!r} and {args.pdm_layers!r}")
    shape = MODELS[args.model]
    try:
        args.widths = ([int(x) for x in args.pdm_intermediate.split(",")]
                       if args.pdm_intermediate else [shape.intermediate])
    except ValueError:
        sys.exit(f"--pdm-intermediate takes comma-separated integers, got {args.pdm_intermediate!r}")
    bad = [n for n in stages if not 1 <= n <= shape.layers]
    if bad or min(pdm_layers) < 1:
        sys.exit(f"--stages must lie in 1..{shape.layers} and --pdm-layers be >= 1")
    print(f"{shape.name} on {describe_device(device)}, {str(dtype)[6:]}, context {args.context}, "
          f"draft vocabulary {args.draft_vocab}")
    head = (f"{'n':>3}{'L_s':>5}{'MLP':>7}{'draft':>7}{'stage layers':>14}{'stage us':>11}{'draft us':>11}"
            f"{'verify us':>11}{'draft/stage':>13}{'(draft+verify)/stage':>22}  hidden")
    print(head)
    rows = []
    with torch.no_grad():
        for n in stages:
            for r in measure(args, shape, n, pdm_layers, device, dtype, timer):
                rows.append(r)
                print(f"{r['n']:>3}{r['pdm_layers']:>5}{r['pdm_intermediate']:>7}"
                      f"{r['draft_mode'][:6]:>7}"
                      f"{r['stage_layers']:>14}"
                      f"{r['stage_us']:>11.1f}{r['draft_us']:>11.1f}{r['verify_us']:>11.1f}"
                      f"{r['draft_over_stage']:>13.2f}{r['rank0_over_stage']:>22.2f}  "
                      f"{'yes' if r['rank0_hidden'] else 'draft only' if r['draft_hidden'] else 'no'}",
                      flush=True)
    out = args.json_out or RESULTS / f"{args.date}-draft-hiding-{device_tag(device)}.json"
    write_json(out, run_meta(device, date=args.date, dtype=str(dtype), model=vars(shape),
                             draft_vocab=args.draft_vocab, context=args.context,
                             iters=timer.iters), rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
