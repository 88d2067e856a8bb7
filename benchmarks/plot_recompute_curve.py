"""The selective-recompute fidelity curve: a table (markdown) and a plot from a `ragkv eval`
report whose modes include `sequential`, `METHOD@RATIO` points and (optionally) `blend@1`,
with warm TTFT per point from a `bench_recompute.py` report when given.

r = 0 of every method is the `sequential` mode (nothing recomputed), r = 1 the `blend@1` mode
(everything recomputed: the full prefill, whatever the method). "gap closed" is the share of
the gold log-likelihood gap between `sequential` and `full` that a point closes.

    ragkv eval --limit 60 --modes sequential,blend@0.05,...,blend@1 --json curve.json
    python benchmarks/bench_recompute.py --json ttft.json
    python benchmarks/plot_recompute_curve.py curve.json --ttft ttft.json --plot curve.png
"""

from __future__ import annotations

import argparse
import json


def points(summary: dict) -> dict[str, list[tuple[float, str]]]:
    """method -> [(r, mode name)] ascending, with the r = 0 and r = 1 ends where measured."""
    curves: dict[str, list[tuple[float, str]]] = {}
    for mode in summary:
        if "@" in mode:
            method, _, ratio = mode.partition("@")
            curves.setdefault(method, []).append((float(ratio), mode))
    ends = [(0.0, "sequential")] if "sequential" in summary else []
    one = next((m for m in summary if "@" in m and float(m.partition("@")[2]) == 1.0), None)
    for pts in curves.values():
        pts[:] = [p for p in pts if p[0] != 1.0]
        pts += ends + ([(1.0, one)] if one else [])
        pts.sort()
    return curves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="ragkv eval --json output")
    parser.add_argument("--ttft", default=None, help="bench_recompute.py --json output")
    parser.add_argument("--plot", default=None, help="write the curve here (PNG)")
    args = parser.parse_args()
    with open(args.report) as f:
        summary = json.load(f)["summary"]
    ttft, ttft_full = {}, None
    if args.ttft:
        with open(args.ttft) as f:
            bench = json.load(f)
        ttft = {(p["method"], p["ratio"]): p for p in bench["points"]}
        ttft_full = bench["full_prefill_ttft_s"]
    full = summary["full"]["overall"]
    seq = summary["sequential"]["overall"]
    gap = full["gold_logprob"] - seq["gold_logprob"]
    curves = points(summary)
    two_hop_full = summary["full"]["by_task"].get("two-hop", {}).get("accuracy")
    print("| method | r | accuracy | % of full | two-hop acc | % of full | gold LL | gap closed "
          "| KL vs full | top-1 | warm TTFT ms | x full | FLOP bound |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for method, pts in curves.items():
        for r, mode in pts:
            g = summary[mode]["overall"]
            hop = summary[mode]["by_task"].get("two-hop", {}).get("accuracy")
            closed = (g["gold_logprob"] - seq["gold_logprob"]) / gap if gap else float("nan")
            t = ttft.get((method, r))
            timing = (f"{t['warm_ttft_s'] * 1e3:.0f} | {t['speedup']:.1f}x | "
                      f"{t['flop_bound']:.1f}x" if t else "- | - | -")
            hop_text = (f"{hop:.1%} | {hop / two_hop_full:.0%}" if hop is not None
                        and two_hop_full else "- | -")
            share = (f"{g['accuracy'] / full['accuracy']:.0%}" if full["accuracy"] else "-")
            print(f"| {method} | {r:g} | {g['accuracy']:.1%} | {share} | {hop_text} | "
                  f"{g['gold_logprob']:.3f} | {closed:.0%} | "
                  f"{g['kl'] if g['kl'] is not None else 0:.3f} | "
                  f"{g['top1_agreement'] if g['top1_agreement'] is not None else 1:.0%} | "
                  f"{timing} |")
    hop = "-" if two_hop_full is None else f"{two_hop_full:.1%}"
    print(f"full: accuracy {full['accuracy']:.1%}, two-hop {hop}, gold LL "
          f"{full['gold_logprob']:.3f}" + (f", TTFT {ttft_full * 1e3:.0f} ms" if ttft else ""))
    if not args.plot:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("accuracy", lambda m: summary[m]["overall"]["accuracy"], full["accuracy"]),
              ("two-hop accuracy", lambda m: summary[m]["by_task"]["two-hop"]["accuracy"],
               two_hop_full),
              ("gold answer log-likelihood", lambda m: summary[m]["overall"]["gold_logprob"],
               full["gold_logprob"]),
              ("KL(full || mode), nats", lambda m: summary[m]["overall"]["kl"] or 0.0, 0.0))
    fig, axes = plt.subplots(1, len(panels) + (1 if ttft else 0), figsize=(22, 4))
    for ax, (title, value, reference) in zip(axes, panels, strict=False):
        for method, pts in curves.items():
            ax.plot([r for r, _ in pts], [value(m) for _, m in pts], marker="o", label=method)
        ax.axhline(reference, color="black", linestyle="--", linewidth=1, label="full")
        ax.set_title(title)
        ax.set_xlabel("recompute ratio r")
        ax.legend()
    if ttft:
        ax = axes[-1]
        for method in curves:
            pts = sorted((r, p) for (m, r), p in ttft.items() if m == method)
            if not pts:
                continue
            line, = ax.plot([r for r, _ in pts], [p["warm_ttft_s"] * 1e3 for _, p in pts],
                            marker="o", label=f"{method} measured")
            ax.plot([r for r, _ in pts], [ttft_full * 1e3 / p["flop_bound"] for _, p in pts],
                    color=line.get_color(), linestyle=":", label=f"{method} FLOP bound")
        ax.axhline(ttft_full * 1e3, color="black", linestyle="--", linewidth=1,
                   label="full prefill")
        ax.set_title("warm TTFT, ms (bench shape, builtin:small)")
        ax.set_xlabel("recompute ratio r")
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot)
    print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
