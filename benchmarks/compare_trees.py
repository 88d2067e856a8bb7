"""Run one benchmark script from two source trees, interleaved, and compare their outputs.

Meant for refactors: to show that no figure got worse than before by more than noise, the
same benchmark is run from a frozen copy of the old tree and from the new tree, in one
process tree on one machine, alternating which goes first each round (old,new / new,old /
...) so that drift (thermal, background load, caches) hurts neither side.

    python benchmarks/compare_trees.py --old /tmp/ragkv_old --new . --rounds 3 -- \\
        benchmarks/bench_step_overhead.py --rag-requests 100
    python benchmarks/compare_trees.py --old /tmp/ragkv_old --new . --rounds 3 -- \\
        benchmarks/bench_rag.py --model builtin:small --no-hf

Everything after `--` is the script, as a path relative to each tree root (each tree runs
its own copy), and its arguments. Each run has cwd = the tree, PYTHONPATH = the tree first,
and a small `python -c` wrapper that puts the tree ahead of site-packages on sys.path and
checks, before and after the script, that `ragkv` (--package) was imported from that tree:
the editable install's finder would otherwise resolve `import ragkv` to /work/main whenever
the tree is not ahead of it (a script run by path sees its own folder first, not the cwd).

Outputs are aligned line by line by their "shape": the text with every number (12, 1.5,
2,048, 0.93x, 12.3%, -4e-05) replaced by a placeholder and whitespace collapsed; the n-th
occurrence of a shape in one output is matched with the n-th in the other. For each number
of a matched line, the table gives the median over rounds, old -> new, with new/old and a
noise figure (the larger relative spread, (max - min) / median, of the two sides over the
rounds); `*` marks a change larger than that noise. Numbers equal in every run (labels such
as a batch size) are shown as they are. Lines found in only one tree are listed apart, so a
renamed label shows up instead of silently dropping out. --verbose adds the per-round
values, --json FILE writes everything. Stdlib only; exits non-zero if any run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

# Numbers as benchmarks print them. A sign counts only when glued to the digits and not
# following a word character, so "14-64" is a range of two positive numbers and "+1.38" one
# number whose sign may flip; digits glued to a letter before them (fp16, h100) are part of
# a name, not a figure.
NUMBER = re.compile(
    r"(?<![A-Za-z0-9_.])[-+]?"
    r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+(?:\.\d+)?|\.\d+)"
    r"(?:[eE][-+]?\d+)?"
)
PLACEHOLDER = "{#}"
MARKER = "[compare_trees] "

# Runs in the child. sys.path[0] is '' for `python -c`; a script run by path would see its
# own folder there, so that is restored. The tree then goes right after it, ahead of
# site-packages and any editable-install finder; PYTHONPATH carries the same tree into
# subprocesses the benchmark starts itself.
WRAPPER = """\
import importlib.util, os, runpy, sys
tree, package, marker, script = sys.argv[1:5]
sys.argv = [script, *sys.argv[5:]]
sys.path[:] = [os.path.dirname(script), tree,
               *[p for p in sys.path[1:] if os.path.abspath(p or '.') != tree]]

def origin(where):
    mod = sys.modules.get(package)
    if mod is not None:
        path = getattr(mod, '__file__', None) or next(iter(getattr(mod, '__path__', [])), '')
    else:
        spec = importlib.util.find_spec(package)
        path = (spec.origin or next(iter(spec.submodule_search_locations or []), '')
                if spec else '')
    path = os.path.abspath(path) if path else ''
    print(marker + where + ' ' + package + '=' + (path or '<not found>'), file=sys.stderr,
          flush=True)
    if not path.startswith(tree + os.sep):
        print(marker + package + ' does not resolve into ' + tree, file=sys.stderr)
        os._exit(3)

origin('before')
try:
    runpy.run_path(script, run_name='__main__')
finally:
    sys.stdout.flush()
    if package in sys.modules:
        origin('after')
"""


@dataclass
class Run:
    tree: str  # "old" or "new"
    round: int
    seconds: float
    stdout: str
    origin: str = ""
    load: float | None = None  # 1-minute load average at the start: other work on the box


@dataclass
class Row:
    """One aligned line: its shape, which occurrence of it, and per tree the numbers of each
    round (values[tree][round] is the list of that line's numbers in that run)."""

    shape: str
    occurrence: int
    texts: dict[str, str] = field(default_factory=dict)  # a sample of the line per tree
    # How each tree first wrote each number, so medians keep its precision and style.
    samples: dict[str, list[str]] = field(default_factory=dict)
    values: dict[str, list[list[float]]] = field(default_factory=dict)


def shape_of(line: str) -> tuple[str, list[str]]:
    tokens = NUMBER.findall(line)
    shape = " ".join(NUMBER.sub(PLACEHOLDER, line).split())
    return shape, tokens


def to_float(token: str) -> float:
    return float(token.replace(",", ""))


def format_like(value: float, sample: str) -> str:
    """A median written the way the benchmark wrote that number (decimals, separators)."""
    sign = "+" if sample.startswith("+") else ""
    if "e" in sample.lower():
        return f"{value:{sign}.3g}"
    decimals = len(sample.split(".")[1]) if "." in sample else 0
    sep = "," if "," in sample else ""
    return f"{value:{sign}{sep}.{decimals}f}"


def parse(stdout: str) -> dict[tuple[str, int], tuple[str, list[str]]]:
    """(shape, occurrence index) -> (the line, its number tokens), in output order."""
    seen: dict[str, int] = {}
    lines = {}
    for raw in stdout.splitlines():
        line = raw.rstrip()
        if not line.strip():
            continue
        shape, tokens = shape_of(line)
        k = seen.get(shape, 0)
        seen[shape] = k + 1
        lines[(shape, k)] = (line.strip(), tokens)
    return lines


def run_once(tree_dir: str, label: str, rnd: int, script: str, args: list[str], package: str,
             timeout: float | None) -> Run:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree_dir, env.get("PYTHONPATH")) if p)
    script_path = os.path.join(tree_dir, script)
    cmd = [sys.executable, "-c", WRAPPER, tree_dir, package, MARKER, script_path, *args]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=tree_dir, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        fail(label, rnd, f"timed out after {timeout} s", _text(e.stderr), _text(e.stdout))
    seconds = time.perf_counter() - start
    origins = [ln[len(MARKER):] for ln in proc.stderr.splitlines() if ln.startswith(MARKER)]
    if proc.returncode != 0:
        fail(label, rnd, f"exit status {proc.returncode}", proc.stderr, proc.stdout)
    return Run(label, rnd, seconds, proc.stdout, origins[0] if origins else "", load)


def _text(data: str | bytes | None) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""


def fail(label: str, rnd: int, why: str, stderr: str, stdout: str) -> None:
    print(f"\n{label} tree, round {rnd + 1}: {why}", file=sys.stderr)
    for name, text in (("stdout", stdout), ("stderr", stderr)):
        tail = text.splitlines()[-30:]
        if tail:
            print(f"--- {name} (last {len(tail)} lines) ---", file=sys.stderr)
            print("\n".join(tail), file=sys.stderr)
    sys.exit(1)


def collect(runs: list[Run], rounds: int) -> tuple[list[Row], list[Row], list[Row]]:
    """Aligned rows in the new tree's order, then the rows only one tree printed."""
    rows: dict[tuple[str, int], Row] = {}
    order: dict[str, list[tuple[str, int]]] = {"old": [], "new": []}
    for run in runs:
        for key, (line, tokens) in parse(run.stdout).items():
            row = rows.get(key)
            if row is None:
                row = rows[key] = Row(key[0], key[1])
            if run.tree not in row.values:
                row.samples[run.tree] = tokens
                row.values[run.tree] = [[] for _ in range(rounds)]
                row.texts[run.tree] = line
                order[run.tree].append(key)
            row.values[run.tree][run.round] = [to_float(t) for t in tokens]
    both = [rows[k] for k in order["new"] if "old" in rows[k].values]
    only_old = [rows[k] for k in order["old"] if "new" not in rows[k].values]
    only_new = [rows[k] for k in order["new"] if "old" not in rows[k].values]
    return both, only_old, only_new


def per_number(row: Row, tree: str, i: int) -> list[float]:
    """That number over the rounds in which the line appeared."""
    return [vals[i] for vals in row.values.get(tree, []) if vals]


def spread(xs: list[float]) -> float | None:
    med = statistics.median(xs)
    if len(xs) < 2 or med == 0:
        return None
    return (max(xs) - min(xs)) / abs(med)


def summarize(row: Row) -> list[dict]:
    out = []
    for i in range(row.shape.count(PLACEHOLDER)):
        old, new = per_number(row, "old", i), per_number(row, "new", i)
        entry: dict = {"index": i, "old": old, "new": new, "constant": False}
        if not old or not new:
            out.append(entry)
            continue
        mo, mn = statistics.median(old), statistics.median(new)
        entry.update(old_median=mo, new_median=mn)
        if len(set(old + new)) == 1:
            entry["constant"] = True
        else:
            ratio = mn / mo if mo else None
            noises = [s for s in (spread(old), spread(new)) if s is not None]
            noise = max(noises) if noises else None
            entry.update(ratio=ratio, noise=noise,
                         beyond_noise=bool(ratio is not None and noise is not None
                                           and abs(ratio - 1) > noise))
        out.append(entry)
    return out


def render(row: Row, numbers: list[dict], tree: str | None = None) -> str:
    """The line's shape with each number filled in: as is when constant, else old->new."""
    parts = row.shape.split(PLACEHOLDER)
    text = parts[0]
    for entry, rest in zip(numbers, parts[1:], strict=True):
        i = entry["index"]
        if tree is not None:
            vals = entry[tree]
            cell = format_like(statistics.median(vals), row.samples[tree][i]) if vals else "?"
        elif entry["constant"]:
            cell = row.samples["new"][i]
        elif "old_median" in entry:
            cell = (f"{format_like(entry['old_median'], row.samples['old'][i])}->"
                    f"{format_like(entry['new_median'], row.samples['new'][i])}")
        else:
            cell = "?"
        text += cell + rest
    return text


def change_text(entry: dict) -> str:
    ratio, noise = entry.get("ratio"), entry.get("noise")
    if ratio is None:
        return "n/a"
    noise_s = f"+-{noise * 100:.1f}%" if noise is not None else "+-?"
    mark = " *" if entry.get("beyond_noise") else ""
    return f"x{ratio:.3f} ({(ratio - 1) * 100:+.1f}%, noise {noise_s}){mark}"


def fmt_rounds(xs: list[list[float]], i: int) -> str:
    return "[" + ", ".join(f"{v[i]:g}" if v else "-" for v in xs) + "]"


def main() -> None:
    # Split by hand at the first "--": the script's own options must reach it untouched.
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = _parser()
    opts = parser.parse_args(argv[:cut])
    if cut + 1 >= len(argv):
        parser.error("give the benchmark script (and its arguments) after --")
    if opts.rounds < 1:
        parser.error("--rounds must be at least 1")
    script, script_args = argv[cut + 1], argv[cut + 2:]
    trees = {"old": os.path.realpath(opts.old), "new": os.path.realpath(opts.new)}
    if os.path.isabs(script):
        # An absolute path would run one copy for both trees; take it relative to its tree.
        for root in trees.values():
            if script.startswith(root + os.sep):
                script = os.path.relpath(script, root)
                break
        else:
            sys.exit(f"compare_trees.py: {script} is in neither tree; give it relative to them")
    for label, root in trees.items():
        if not os.path.isfile(os.path.join(root, script)):
            sys.exit(f"compare_trees.py: {label} tree has no {script}")

    print(f"old: {trees['old']}\nnew: {trees['new']}\n"
          f"script: {' '.join([script, *script_args])}\nrounds: {opts.rounds}", flush=True)
    runs: list[Run] = []
    for rnd in range(opts.rounds):
        # Alternate who goes first, so a slow drift over the session favours neither side.
        labels = ("old", "new") if rnd % 2 == 0 else ("new", "old")
        for label in labels:
            run = run_once(trees[label], label, rnd, script, script_args, opts.package,
                           opts.timeout)
            runs.append(run)
            load = f", load {run.load:.2f}" if run.load is not None else ""
            print(f"  round {rnd + 1}, {label}: {run.seconds:6.1f} s{load}  ({run.origin})",
                  flush=True)

    both, only_old, only_new = collect(runs, opts.rounds)
    summaries = [(row, summarize(row)) for row in both]
    left = [render(row, nums) for row, nums in summaries]
    width = min(max((len(s) for s in left), default=0), 100)
    print("\nmedians over rounds, old->new; change = new/old; noise = larger (max-min)/median"
          " of the two sides; * = change beyond noise")
    if opts.rounds < 3:
        # Two values give a range, not a spread: noise is understated, * fires too easily.
        print("(fewer than 3 rounds: the noise figure is a rough lower bound)")
    print()
    for (row, nums), text in zip(summaries, left, strict=True):
        moving = [e for e in nums if "ratio" in e or ("old_median" not in e)]
        changes = "; ".join(
            (f"#{e['index'] + 1} " if len(moving) > 1 else "") + change_text(e)
            for e in moving)
        print(f"{text:<{width}}  {changes}".rstrip() if changes else text)
        if opts.verbose:
            for e in moving:
                print(f"    #{e['index'] + 1} old {fmt_rounds(row.values['old'], e['index'])}"
                      f"  new {fmt_rounds(row.values['new'], e['index'])}")
    for label, rows in (("old", only_old), ("new", only_new)):
        if rows:
            print(f"\nlines only in the {label} tree's output (medians):")
            for row in rows:
                print("  " + render(row, summarize(row), tree=label))

    flagged = sum(1 for _, nums in summaries for e in nums if e.get("beyond_noise"))
    walls = {lb: statistics.median(r.seconds for r in runs if r.tree == lb) for lb in trees}
    print(f"\n{len(both)} lines compared, {flagged} numbers changed beyond noise; "
          f"{len(only_old)} lines only in old, {len(only_new)} only in new; "
          f"median run time old {walls['old']:.1f} s, new {walls['new']:.1f} s")

    if opts.json:
        report = {
            "trees": trees, "script": script, "args": script_args, "rounds": opts.rounds,
            "runs": [{"tree": r.tree, "round": r.round, "seconds": r.seconds,
                      "origin": r.origin, "load": r.load, "stdout": r.stdout} for r in runs],
            "compared": [{"shape": row.shape, "occurrence": row.occurrence,
                          "line": render(row, nums), "texts": row.texts, "numbers": nums}
                         for row, nums in summaries],
            "only_old": [{"shape": r.shape, "occurrence": r.occurrence,
                          "values": r.values["old"]} for r in only_old],
            "only_new": [{"shape": r.shape, "occurrence": r.occurrence,
                          "values": r.values["new"]} for r in only_new],
        }
        with open(opts.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {opts.json}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        usage="%(prog)s --old DIR --new DIR [options] -- SCRIPT [ARGS...]")
    parser.add_argument("--old", required=True, help="the tree before the change")
    parser.add_argument("--new", required=True, help="the tree after the change")
    parser.add_argument("--rounds", type=int, default=3, help="runs per tree (default 3)")
    parser.add_argument("--package", default="ragkv",
                        help="the package that must import from each tree (default ragkv)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per run")
    parser.add_argument("--verbose", "-v", action="store_true", help="per-round values")
    parser.add_argument("--json", default=None, help="write everything to this file")
    return parser


if __name__ == "__main__":
    main()
