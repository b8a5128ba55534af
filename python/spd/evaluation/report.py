"""The evaluation grid's report: a markdown table shaped like the paper's Table 2, and plots.

Reads the state `spd.evaluation.grid.run_grid` keeps (`grid.json`). Per method configuration and
dataset: theoretical speedup, draft-cost-adjusted speedup (cost model, measured on the run's
device) and, where the run measures something real, the decode tokens/s ratio over AR. Then the
batched rows: ar, pp and spd with B sequences at once, projected from the cost model's pieces
over B rows (`spd.evaluation.batched`), and where spd (and pp) overtake batched AR and stop.
Plots: speedup against n per method, and acceptance by draft position.
"""
from __future__ import annotations

from pathlib import Path

from spd.evaluation import methods
from spd.evaluation.batched import crossover
from spd.evaluation.cost_model import Costs
from spd.evaluation.evaluate import add_totals
from spd.evaluation.grid import METHODS, derived

OVERALL = "overall"


def _rows_by_config(state: dict) -> dict:
    """{temperature: {config: {dataset: cell}}} with an 'overall' entry per config.

    Speedups are recomputed from the counts and the current cost model, so a re-measured cost
    model (--recost) applies to every cell alike."""
    costs = Costs.from_dict(state["costs"])
    out: dict = {}
    for cell in state["cells"].values():
        out.setdefault(cell["temperature"], {}).setdefault(cell["config"], {})[cell["dataset"]] = cell
    for by_config in out.values():
        ar = by_config.get(methods.reference().config(1, None), {})
        for by_ds in by_config.values():
            for ds, cell in list(by_ds.items()):
                if "totals" in cell:
                    by_ds[ds] = dict(cell, derived=derived(cell, costs,
                                                           ar.get(ds, {}).get("totals")))
        ar_all = _merge(list(ar.values()))
        for by_ds in by_config.values():
            merged = _merge(list(by_ds.values()))
            if merged is not None:
                merged["derived"] = derived(merged, costs, ar_all and ar_all["totals"])
                by_ds[OVERALL] = merged
    return out


def _merge(cells: list[dict]) -> dict | None:
    """One cell whose totals are the sums over `cells` (datasets of one configuration)."""
    cells = [c for c in cells if "totals" in c]
    if not cells:
        return None
    first = cells[0]
    return {k: first[k] for k in ("method", "n", "pdm_layers", "config", "temperature")} | {
        "dataset": OVERALL, "totals": add_totals([c["totals"] for c in cells]),
        "draft_steps": first.get("draft_steps", 0)}


def _config_order(config: str, cell: dict) -> tuple:
    return (METHODS.index(cell["method"]), cell["n"], cell.get("pdm_layers") or 0, config)


def batched_rows(state: dict) -> dict:
    """{temperature: [row]}, one row per configuration that runs batched (Method.batched), the
    reference (AR) first: {config, method, n, devices, tok_s {B: tokens/s over all B
    sequences}, per_sequence {B: ...}, vs_ar {B: over batched AR's tokens/s at B}, crossover
    (batched.crossover of vs_ar; None for AR)}. A piece not measured: None at that B."""
    costs = Costs.from_dict(state["costs"])
    sizes = sorted(costs.batch_sizes) or [1]  # a grid stored before them: its B = 1 row
    out: dict = {}
    for temp, by_config in _rows_by_config(state).items():
        rows = []
        order = sorted(by_config.items(),
                       key=lambda kv: _config_order(kv[0], next(iter(kv[1].values()))))
        for config, by_ds in order:
            cell = by_ds.get(OVERALL)
            method = methods.get(cell["method"]) if cell else None
            if method is None or method.batched is None:
                continue
            d = cell["derived"]
            tok = {b: method.batched(costs, cell["n"], b, d["theoretical_speedup"],
                                     d["draft_ms"] * 1e-3, temp == 0) for b in sizes}
            rows.append({"config": config, "method": method.name, "n": cell["n"],
                         "devices": d["devices"], "tok_s": tok,
                         "per_sequence": {b: None if x is None else x / b
                                          for b, x in tok.items()},
                         "reference": method.is_reference})
        ar = next((r["tok_s"] for r in rows if r["reference"]), {})
        for r in rows:
            r["vs_ar"] = {b: None if x is None or not ar.get(b) else x / ar[b]
                          for b, x in r["tok_s"].items()}
            r["crossover"] = None if r.pop("reference") else crossover(r["vs_ar"])
        rows.sort(key=lambda r: not methods.get(r["method"]).is_reference)
        out[temp] = rows
    return out


def _batched_lines(rows: list[dict], costs: dict, temp: float) -> list[str]:
    """The batched rows of one temperature: a table of tokens/s over all B sequences (and
    their ratio over batched AR), one of tokens/s per sequence, and the crossovers."""
    if not rows:
        return []
    sizes = sorted({b for r in rows for b in r["tok_s"]})
    lines = ["", f"Batched, B sequences at once (T = {temp:g}): projections from the cost model "
             f"measured on {costs['device']} (each sequence at {costs['context']} tokens of "
             "context), not decoded batched. Tokens/s over all B sequences (x: over batched AR "
             "at the same B); spd from its cell's S_theory and draft ms/call above, one draft "
             "step over its B windows (the draft ms scaled by the measured batched PDM step); "
             "pp with its B requests in min(B, n) groups. Formulas below.", ""]
    if not costs.get("batch_sizes"):
        lines += ["(The batched pieces were not measured in this grid: B = 1 from the one-row "
                  "pieces. Resuming the grid measures them.)", ""]

    def num(x):
        return "-" if x is None else f"{x:.1f}"
    head = "| method | devices |" + "".join(f" B={b} |" for b in sizes)
    lines += [head, "|" + "---|" * (len(sizes) + 2)]
    for r in rows:
        lines.append(f"| {r['config']} | {r['devices']} |" + "".join(
            f" {num(r['tok_s'][b])}" + ("" if r["crossover"] is None or r["vs_ar"][b] is None
                                        else f" ({r['vs_ar'][b]:.2f}x)") + " |"
            for b in sizes))
    lines += ["", "Tokens/s per sequence:", "", head, "|" + "---|" * (len(sizes) + 2)]
    for r in rows:
        lines.append(f"| {r['config']} | {r['devices']} |" +
                     "".join(f" {num(r['per_sequence'][b])} |" for b in sizes))
    lines += ["", f"Against batched AR, B in {', '.join(map(str, sizes))}:"]
    for r in rows:
        x = r["crossover"]
        if x is None:
            continue
        if not x["beats"]:
            what = "never beats it"
        else:
            what = f"overtakes it at B = {x['overtakes_at']}"
            if x["stops_at"] is None:
                what += f" and still beats it at B = {sizes[-1]}, the largest given"
            else:
                what += (f", stops beating it at B = {x['stops_at']} (the last B that beats "
                         f"it: {x['last_beating']})")
                if x["again"]:
                    what += f"; beats it again at B = {', '.join(map(str, x['again']))}"
        lines.append(f"- {r['config']}: {what}")
    return lines


def markdown(state: dict) -> str:
    rows = _rows_by_config(state)
    batched = batched_rows(state)
    datasets = list(state["settings"]["prompts"])
    costs = state["costs"]
    lines = ["# Evaluation grid", ""]
    tgt = state.get("target", {})
    lines += [f"Target: {tgt.get('name', '?')} (fingerprint {tgt.get('fingerprint', '?')}), "
              f"device {tgt.get('device', '?')}, {tgt.get('dtype', '?')}. "
              f"{state['settings']['max_new_tokens']} new tokens per prompt; prompts per set: "
              + ", ".join(f"{k} {len(v)}" for k, v in state["settings"]["prompts"].items()) + "."]
    if state.get("command"):
        lines += ["", f"Command: `{state['command']}`"]
    lines += ["", "S_theory = alpha * n (EAGLE-3: tokens per verification round; zero draft "
              "cost). S_adj = draft-cost-adjusted speedup over AR from the cost model below. "
              "per dev = S_adj / devices used. tok/s ratio = measured decode tokens/s over AR "
              "in this run, shown only for single-device methods (in one process the pipelined "
              "methods run their stages one after another, so their wall clock is not theirs)."]
    for temp in sorted(rows):
        by_config = rows[temp]
        lines += ["", f"## T = {temp:g}", ""]
        head = "| method | devices |" + "".join(
            f" {d} S_theory | {d} S_adj |" for d in datasets + [OVERALL]) + \
            " overall per dev | overall tok/s ratio | overall acceptance |"
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        order = sorted(by_config.items(),
                       key=lambda kv: _config_order(kv[0], next(iter(kv[1].values()))))
        skipped = []
        for config, by_ds in order:
            if OVERALL not in by_ds:
                reasons = sorted({c["skipped"] for c in by_ds.values() if "skipped" in c})
                skipped += [f"- {config}: {r}" for r in reasons]
                continue
            ov = by_ds[OVERALL]["derived"]
            cells = []
            for d in datasets + [OVERALL]:
                c = by_ds.get(d)
                if c is None or "derived" not in c:
                    cells.append(" - | - |")
                else:
                    cells.append(f" {c['derived']['theoretical_speedup']:.2f} | "
                                 f"{c['derived']['adjusted_speedup']:.2f} |")
            ratio = ov["measured_ratio"]
            acc = f"{ov['acceptance_rate']:.2f}" if by_ds[OVERALL]["totals"]["judged"] else "-"
            lines.append(f"| {config} | {ov['devices']} |" + "".join(cells) +
                         f" {ov['adjusted_speedup_per_device']:.2f} |"
                         f" {'-' if ratio is None else f'{ratio:.2f}'} |"
                         f" {acc} |")
        if skipped:
            lines += ["", "Skipped:", *skipped]
        lines += ["", "Details (all datasets):", "",
                  "| method | N | K | alpha | draft ms/call | decode tok/s |",
                  "|---|---|---|---|---|---|"]
        for config, by_ds in order:
            if OVERALL in by_ds:
                t, d = by_ds[OVERALL]["totals"], by_ds[OVERALL]["derived"]
                lines.append(f"| {config} | {t['N']} | {t['K']} | {d['alpha']:.3f} | "
                             f"{d['draft_ms']:.2f} | {d['decode_tok_s']:.1f} |")
        lines += _batched_lines(batched.get(temp, []), costs, temp)
    lines += ["", "## Cost model (measured in this run)", "",
              f"Device {costs['device']}, context {costs['context']} tokens, median of "
              f"{costs['reps']} runs. Full forward {costs['forward_s'] * 1e3:.2f} ms; final norm + "
              f"LM head {costs['head_s'] * 1e3:.2f} ms."]
    for n, per in costs["stage_s"].items():
        lines.append(f"- n={n}: stage forwards " + ", ".join(f"{x * 1e3:.2f}" for x in per)
                     + " ms")
    for rows_, s in costs["chunk_s"].items():
        lines.append(f"- forward of a {rows_}-token chunk (EAGLE-3 verification, tree rows): "
                     f"{s * 1e3:.2f} ms")
    if costs.get("batch_forward_s"):  # the batched rows' pieces
        bf, bh = costs["batch_forward_s"], costs["batch_head_s"]
        lines.append("- over R rows, one decode row per sequence against its own slot: full "
                     "forward " + ", ".join(f"R={r} {x * 1e3:.2f}" for r, x in bf.items())
                     + " ms; final norm + LM head " + ", ".join(
                         f"R={r} {x * 1e3:.2f}" for r, x in bh.items()) + " ms")
        for n, by_rows in costs["batch_stage_s"].items():
            lines.append(f"- n={n}, stage steps over R rows: " + "; ".join(
                f"R={r} " + ", ".join(f"{x * 1e3:.2f}" for x in per)
                for r, per in by_rows.items()) + " ms")
    runtime = costs.get("runtime_s") or {}
    if runtime:  # measured by bench_protocol.py, added to every pipelined cycle
        lines.append("- the distributed runtime's own cost per cycle, measured ("
                     f"{state.get('runtime_from', 'bench_protocol.py')}): "
                     + ", ".join(f"n={n} {x * 1e3:.2f} ms" for n, x in sorted(
                         runtime.items(), key=lambda kv: int(kv[0]))))
    else:
        lines.append("- the distributed runtime's own cost per cycle: not charged (none "
                     "measured: `--runtime-from` a bench_protocol.py JSON)")
    lines += ["", "Draft steps are timed inside each method's own decoding (draft ms/call "
              "above). Each cost is charged where it runs (t_fwd full forward, t_i stage i, "
              "t_head final norm + LM head; a cycle is the slowest device's work in it, and at "
              "least t_fwd / n, the balanced cycle S_theory assumes):",
              "- pp: t_fwd / max(t_fwd, sum of t_i + t_head)",
              "- spd: S_theory/n * t_fwd / cycle; greedy, the last stage runs t_i + t_head (it "
              "judges the draft) and the draft rank t_draft; under sampling the stages run t_i "
              "and the draft rank t_draft + t_head (it judges)",
              "- spd-nd (n devices, the PDM on stage 0's): S_theory/n * t_fwd / cycle, cycle = "
              "the slowest stage of the balanced split of the measured layer costs, stage 0 "
              "also running t_draft (+ t_head under sampling), the last t_head when greedy",
              "- spd-tree (a token tree of width W): as spd with every t_i scaled by "
              "t_chunk(W) / t_fwd (W rows a stage step, as this device computes them)",
              "- ppsd: S_theory/n * t_fwd / cycle, cycle = (slowest t_i, the last with t_head) "
              "+ t_draft (drafting waits for each step)",
              "- eagle3: S_theory * t_fwd / (k * t_draft + max(t_fwd, t_chunk(k+1)))",
              "",
              "Batched rows (B sequences at once; x(R): the piece over R rows, one per "
              "sequence; tokens/s over all B):",
              "- ar (one device): B / t_fwd(B)",
              "- pp (n devices): the B requests as g = min(B, n) groups of r_1 >= ... >= r_g "
              "rows (as even as they go), each a token per trip through the n stages: "
              "B / max(t_fwd(r_1), sum of t_i(r_1) + t_head(r_1), sum over groups of "
              "t_fwd(r_j) / n, the most any stage i spends on all groups, sum of t_i(r_j) (the "
              "last + t_head(r_j)))",
              "- spd (n + 1 devices): B * S_theory/n / cycle_B, cycle_B = max(t_fwd(B) / n, "
              "t_i(B) (greedy: the last + t_head(B)), t_draft * d(B) (+ t_head(B) under "
              "sampling: the draft rank's one draft step over the B windows, d(B) the measured "
              "batched PDM step over B windows against one's, and its head over the B judged "
              "rows)), plus the runtime's measured cost per cycle where given"]
    return "\n".join(lines) + "\n"


def plots(state: dict, out_dir) -> list[Path]:
    """speedup_vs_n.png and acceptance_by_position.png; [] if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out_dir = Path(out_dir)
    rows = _rows_by_config(state)
    temps = sorted(rows)
    written = []

    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4.5), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        series: dict = {}
        flat = []
        for config, by_ds in rows[temp].items():
            if OVERALL not in by_ds:
                continue
            c = by_ds[OVERALL]
            m = methods.get(c["method"])
            label = c["method"] + (f" L_s={c['pdm_layers']}" if m.per_depth else "")
            if not m.staged:
                flat.append((label, m, c["derived"]))
            else:
                series.setdefault(label, []).append((c["n"], c["derived"]))
        for i, (label, pts) in enumerate(sorted(series.items())):
            pts.sort()
            xs = [n for n, _ in pts]
            line, = ax.plot(xs, [d["theoretical_speedup"] for _, d in pts], "o-",
                            label=f"{label} (theory)")
            ax.plot(xs, [d["adjusted_speedup"] for _, d in pts], "s--", color=line.get_color(),
                    label=f"{label} (draft-cost adjusted)")
        for label, m, d in flat:
            line = ax.axhline(d["theoretical_speedup"], linestyle="-", alpha=0.6,
                              label=f"{label} (theory)", color="gray" if m.is_reference else None)
            if not m.is_reference:
                ax.axhline(d["adjusted_speedup"], linestyle="--", color=line.get_color(),
                           alpha=0.6, label=f"{label} (draft-cost adjusted)")
        _finish(ax, "pipeline stages n", "speedup over AR",
                f"Speedup vs n (all datasets, T={temp:g})")
    written.append(_save(fig, out_dir / "speedup_vs_n.png"))

    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4.5), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        for config, by_ds in sorted(rows[temp].items()):
            c = by_ds.get(OVERALL)
            if c is None or not c["totals"]["by_position"]:
                continue
            pts = sorted((int(p), a / j) for p, (j, a) in c["totals"]["by_position"].items() if j)
            ax.plot([p for p, _ in pts], [r for _, r in pts], "o-", label=config)
        ax.set_ylim(0, 1)
        _finish(ax, "draft position (EAGLE-3: chain step; SPD/PPSD: tokens in flight when "
                "drafted)", "acceptance rate", f"Acceptance by draft position (T={temp:g})")
    written.append(_save(fig, out_dir / "acceptance_by_position.png"))
    return written


def _finish(ax, xlabel: str, ylabel: str, title: str) -> None:
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # n and positions are whole numbers
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(state: dict, out_dir) -> list[Path]:
    out_dir = Path(out_dir)
    md = out_dir / "report.md"
    md.write_text(markdown(state))
    return [md, *plots(state, out_dir)]


__all__ = ["markdown", "plots", "write_report"]
