"""report.py: the engine of every study report: the runs as arrays, the estimators, the bootstrap over seeds, the
decision rules, and how a report is written: summary.json, table.md rendered from that JSON alone (fmt.py) so that
`sweep.py render` gives the same bytes again, the figures, and records.json.xz, the runs' records it was computed
from.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from studylib import runner

PAPER_MU = 5.28  # the paper's generation/training cost ratio (Qwen2.5-7B)


@dataclass
class Args:
    """What every study report reads and where it writes (a study's Args adds its own)."""

    out_dir: str = "runs/study"
    """folder of the run folders (`sweep.py run --grid ...`)."""
    report_dir: str | None = None
    """where table.md, summary.json, records.json.xz and the figures go (default: --out-dir)."""
    records: str | None = None
    """a records file (records.json.xz, as the report writes beside it; gzip or plain JSON also) to recompute the
    report from, instead of the run folders."""


def source(args) -> str:
    """Where a report's runs come from, as its lines name it: --records FILE, else the --out-dir folder."""
    return f"--records {args.records}" if args.records else args.out_dir


def evals(run: dict) -> list[dict]:
    return [r for r in run["records"] if "eval/greedy_acc" in r]


def final(runs: list[dict], key: str) -> list[float]:
    return [evals(r)[-1][key] for r in runs]


def compute(rec: dict, mu: float) -> float:
    """The paper's units: training a rollout costs 1, generating one costs mu."""
    return rec.get("trained_rollouts", 0) + mu * rec.get("generated_rollouts", 0)


def x_of(axis: str, mus: dict):
    """A record's cost so far on one axis: its generated tokens or rollouts, or its compute at mus[axis]."""
    key = {"tokens": "total_generated_tokens", "rollouts": "generated_rollouts"}.get(axis)
    return (lambda r: r.get(key, 0)) if key else (lambda r: compute(r, mus[axis]))


def measured_mu(runs: list[dict]) -> float:
    """The median of the runs' last logged mu (nan where none logged it)."""
    return float(np.median([r["records"][-1]["mu"] for r in runs if "mu" in r["records"][-1]] or [math.nan]))


def at_shared_steps(runs: list[dict], columns: dict, records=evals) -> dict:
    """{name: [run, step]}: each column (a function of a record) at the steps that every run has a record of
    (records(run): its evaluations by default), in step order."""
    by_step = [{r["step"]: r for r in records(run)} for run in runs]
    steps = sorted(set.intersection(*(set(b) for b in by_step)))
    return {name: np.array([[f(b[t]) for t in steps] for b in by_step], dtype=float) for name, f in columns.items()}


def curve(runs: list[dict], y: str, x, eval_only: bool = True) -> dict:
    """Over seeds at each step all of them logged y: median x, and median / IQR of y."""
    pick = evals if eval_only else (lambda run: run["records"])
    a = at_shared_steps(runs, {"x": x, "y": lambda r: r[y]}, records=lambda run: [r for r in pick(run) if y in r])
    q = np.percentile(a["y"], [25, 50, 75], axis=0)
    return {"x": np.median(a["x"], axis=0), "q25": q[0], "median": q[1], "q75": q[2]}


def cells_of(runs: list[dict], paper_mu: float):
    """The runs of a learning-rate sweep as arrays, on the seeds every (config, lr) finished: returns the cells, those
    seeds and the measured mu. A configuration's cell holds x[axis] [evaluation] (median over its runs, at the
    evaluations all of them made, so that its learning rates share their x values) and per learning rate: cfg, mu,
    acc [seed, evaluation], and the trained batch's entropy [seed, step] with its generated rollouts entropy_x
    [step]."""
    seeds_of: dict[tuple, list] = {}
    for r in runs:
        seeds_of.setdefault((r["config"], r["cfg"]["lr"]), []).append(r["seed"])
    for (config, lr), have in seeds_of.items():
        if len(set(have)) < len(have):  # two variants at one lr: the cell would mix them
            raise SystemExit(f"error: {config} at lr {lr:g} has several runs of one seed: keep one variant per lr")
    seeds = sorted(set.intersection(*(set(v) for v in seeds_of.values()))) if seeds_of else []
    for (config, lr), have in sorted(seeds_of.items()):
        if out := sorted(set(have) - set(seeds)):
            print(f"report: {config} lr {lr:g}: seeds {out} left out (not every cell has them)")
    if not seeds:
        raise SystemExit("error: no seed has finished runs of every configuration and learning rate")
    kept = sorted((r for r in runs if r["seed"] in seeds), key=lambda r: (r["seed"], r["cfg"]["lr"]))
    mu, cells = measured_mu(kept), {}
    mus = {"compute_measured_mu": mu, "compute_paper_mu": paper_mu}
    axes = ("rollouts", *mus)
    for config in dict.fromkeys(r["config"] for r in kept):
        rs = [r for r in kept if r["config"] == config]
        a = at_shared_steps(rs, {"acc": lambda e: e["eval/greedy_acc"], **{ax: x_of(ax, mus) for ax in axes}})
        if any(len(evals(r)) > a["acc"].shape[1] for r in rs):
            print(f"report: {config}: evaluations that not every run made are left out")
        cell = cells[config] = {"x": {ax: np.median(a[ax], axis=0) for ax in axes}, "lrs": {}}
        for lr in dict.fromkeys(r["cfg"]["lr"] for r in rs):
            at = [i for i, r in enumerate(rs) if r["cfg"]["lr"] == lr]
            columns = {"entropy": lambda rec: rec["entropy"], "x": lambda rec: rec.get("generated_rollouts", 0)}
            trained = at_shared_steps(
                [rs[i] for i in at], columns, records=lambda r: [e for e in r["records"] if "entropy" in e]
            )
            cell["lrs"][lr] = {
                "cfg": rs[at[0]]["cfg"],
                "mu": float(np.median([rs[i]["records"][-1].get("mu", math.nan) for i in at])),
                "acc": a["acc"][at],
                "entropy": trained["entropy"],
                "entropy_x": np.median(trained["x"], axis=0),
            }
    return cells, seeds, mu


def config_row(cell: dict) -> dict:
    """A configuration's schedule, its evaluations' generated rollouts and its measured mu (median over its lrs)."""
    cfg = next(iter(cell["lrs"].values()))["cfg"]
    return {
        "N": cfg["buffer_size"],
        "B": cfg["batch_size"],
        "R": cfg["prompts_per_step"] * cfg["group_size"],
        "steps": cfg["total_steps"],
        "eval_every": cfg["eval_every"],
        "lrs": sorted(cell["lrs"]),
        "eval_rollouts": cell["x"]["rollouts"].tolist(),
        "mu": float(np.median([at["mu"] for at in cell["lrs"].values()])),
    }


def gather(tables) -> dict[str, dict[str, list[float]]]:
    """Per-bucket tables ({staleness bucket: {diagnostic: value}}, one per step or run) as {bucket: {key: [values]}}."""
    out = {}
    for table in tables:
        for label, row in table.items():
            for key, value in row.items():
                out.setdefault(label, {}).setdefault(key, []).append(value)
    return out


def bucket_order(label: str) -> int:
    """'0', '1', '2-3', '4-7', '8+' (replay_grpo.STALENESS_BUCKETS) in staleness order."""
    return int(label.split("-")[0].rstrip("+"))


def quartiles(values) -> tuple[float, float, float]:
    q25, q50, q75 = np.percentile(np.asarray(values, dtype=float), [25, 50, 75])
    return float(q25), float(q50), float(q75)


def iqm(a: np.ndarray) -> np.ndarray:
    """The interquartile mean over axis 0: the mean of what is left after int(n / 4) values are cut from each
    end (as scipy.stats.trim_mean(a, 0.25)); the mean itself for fewer than 4 values."""
    a = np.sort(np.asarray(a, dtype=float), axis=0)
    cut = len(a) // 4
    return a[cut : len(a) - cut].mean(axis=0)


def frontier(curves: list[np.ndarray]) -> np.ndarray:
    """The running maximum over evaluations of the maximum over learning rates (curves share their x values)."""
    return np.maximum.accumulate(np.max(curves, axis=0))


def frontier_at(x: np.ndarray, f: np.ndarray, budget: float) -> float:
    """The frontier's value at a cost budget: the best reached at cost <= budget."""
    return float(f[np.searchsorted(x, budget + 1e-9, side="left") - 1])


def first_reach(x: np.ndarray, y: np.ndarray, level: float) -> float:
    """x at the first evaluation where y reaches level (1e-9 of rounding allowed); inf when none does."""
    hit = np.nonzero(np.asarray(y) >= level - 1e-9)[0]
    return float(x[hit[0]]) if len(hit) else math.inf


def first_crossing(x: np.ndarray, f: np.ndarray, level: float) -> float:
    """The x where a non-decreasing frontier f first reaches level, linear between the evaluations around it;
    x's last value (the run's final compute) when it never does."""
    hit = np.nonzero(f >= level)[0]
    if not len(hit):
        return float(x[-1])
    i = int(hit[0])
    if i == 0:
        return float(x[0])
    return float(x[i - 1] + (level - f[i - 1]) / (f[i] - f[i - 1]) * (x[i] - x[i - 1]))


def saving(cost: float, reference_cost: float) -> float:
    """Percent of the reference's cost saved: -inf when the level is never reached (cost inf); nan when the
    reference's cost is 0 (reached before training: nothing to save) or inf (the reference never got there)."""
    if not 0 < reference_cost < math.inf:
        return math.nan
    return -math.inf if cost == math.inf else 100 * (1 - cost / reference_cost)


def costs(x: dict, y: np.ndarray, levels: dict, target: float) -> dict:
    """{axis: {level: first_reach on x[axis] of y to the level's fraction of target}}."""
    return {axis: {name: first_reach(xs, y, f * target) for name, f in levels.items()} for axis, xs in x.items()}


def savings(cost: dict, reference_cost: dict) -> dict:
    """saving() of each cost ({axis: {level: cost}}) against the reference's at the same axis and level."""
    return {axis: {n: saving(c, reference_cost[axis][n]) for n, c in at.items()} for axis, at in cost.items()}


def level_saving(costs: list[float], reference_costs: list[float]) -> float:
    """1 - exp(mean log(cost / reference cost)), in percent; nan where a cost is 0 (a level reached before any
    training: the ratio says nothing)."""
    c, r = np.asarray(costs, dtype=float), np.asarray(reference_costs, dtype=float)
    if (c <= 0).any() or (r <= 0).any():
        return math.nan
    return float(100 * (1 - np.exp(np.mean(np.log(c / r)))))


def bootstrap(estimate, draw, replicates: int, *, seed: int = 0, ps: tuple = (5, 95)) -> tuple[dict, dict]:
    """estimate (a nested dict of numbers) on `replicates` resamples of the seeds: the percentiles ps of each number
    over the replicates, and the replicates as arrays. draw(rng): a resample's positions of the seeds (which may
    repeat one); an int n in its place: a paired resample of n seeds, one draw of positions for every configuration
    and learning rate alike (a seed fixes the warm start they all share)."""
    rng = np.random.default_rng(seed)
    draws = (rng.integers(0, draw, draw) if isinstance(draw, int) else draw(rng) for _ in range(replicates))
    replicates = stack([estimate(idx) for idx in draws])
    return intervals_of(replicates, ps), replicates


def stack(trees: list):
    """A list of equally nested dicts of floats -> one nested dict of arrays (over the list)."""
    if isinstance(trees[0], dict):
        return {k: stack([t[k] for t in trees]) for k in trees[0]}
    return np.array(trees, dtype=float)


def intervals_of(tree, ps: tuple):
    """The nesting of `tree` (dicts), each array of replicates replaced by its percentiles ps (method "nearest"), over
    the replicates where it is defined (not nan); None for each where none is."""
    if isinstance(tree, dict):
        return {k: intervals_of(v, ps) for k, v in tree.items()}
    v = np.asarray(tree, dtype=float)
    v = v[~np.isnan(v)]
    return [float(np.percentile(v, p, method="nearest")) for p in ps] if len(v) else [None] * len(ps)


def meets(saving: float, low: float | None, target: float) -> bool:
    """A saving meets the target: at least target percent, with its interval's lower end above 0."""
    return saving >= target and low is not None and low > 0


def interval_verdict(low: float | None, high: float | None, target: float) -> str:
    """'met' when the whole interval is at or above the target, 'not met' when it is all below, else 'not
    resolvable' (so also when the saving is undefined)."""
    if low is None:
        return "not resolvable"
    return "met" if low >= target else "not met" if high < target else "not resolvable"


def strict_json(x):
    """summary.json is plain JSON for any reader: a cost or saving that is never reached (+-inf) is
    "never", an undefined one (nan) is null."""
    if isinstance(x, dict):
        return {k: strict_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict_json(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else "never"
    return x


def pyplot():
    """matplotlib.pyplot, drawing into files only (a report needs no display); imported when a report draws."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def label_axes(ax, **labels) -> None:
    """An axes' labels (xlabel, ylabel, title) and the light grid of every study figure."""
    ax.set(**labels)
    ax.grid(alpha=0.3)


def frontier_band(ax, x, frontier: dict, band: dict, *, color, label: str, alpha: float) -> None:
    """A frontier as summary.json holds it ({key: value}, a step at each x) with its band ({key: [5th, 95th]})."""
    ax.step(x, list(frontier.values()), where="post", color=color, label=label)
    lo, hi = [band[k][0] for k in frontier], [band[k][1] for k in frontier]
    ax.fill_between(x, lo, hi, step="post", color=color, alpha=alpha)


def save_figure(fig, path: Path, dpi: int = 110, **savefig) -> Path:
    """Lay out, write and close a figure."""
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=dpi, **savefig)
    finally:
        pyplot().close(fig)
    return path


def write_report(dest: Path, s: dict, *, private: str, table_md, plot, records=None) -> None:
    """summary.json (s without its `private` key, as strict JSON), table.md (table_md of that JSON, as a reader
    of summary.json has it), the figures (plot of s) and records.json.xz (records, where given) into dest; an
    unwritable folder stops with one line."""
    text = json.dumps(strict_json({k: v for k, v in s.items() if k != private}), indent=2, allow_nan=False)
    table = table_md(json.loads(text))
    try:
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "table.md").write_text(table)
        (dest / "summary.json").write_text(text)
        figures = plot(s, dest)
    except OSError as e:
        raise SystemExit(f"error: cannot write the report into {dest} ({e.strerror or e})") from None
    print(table)
    written = [dest / "table.md", dest / "summary.json", *figures]
    if records is not None:
        runner.write_records(dest / runner.RECORDS, records, "--report-dir")
        written.append(dest / runner.RECORDS)
    print("wrote", ", ".join(map(str, written)))


def study_report(
    args, grid: str, analyse, *, private, table_md, plot, compact=None, keys=runner.RUN_KEYS, check=runner.run_problem
) -> dict:
    """A study report's main after its arguments. Its input is the runs' compact records: compact(runs, out_dir) of
    the finished runs in args.out_dir (made by `run --grid grid`; default: runner.compact_runs), or args.records (a
    records file, its runs holding keys, each run as check(run) expects or left out) as it is; args.pool_records
    (where a study has it) adds the runs of another. A NaN or infinite number in the compact records stops the report
    (runner.refuse_non_finite). analyse(records, args) is the summary; the report and records.json.xz go into
    args.report_dir (default: out_dir)."""
    out, pooled = Path(args.out_dir), getattr(args, "pool_records", None)
    if args.records:
        data = runner.read_records(Path(args.records), keys, check=check)
        if not data["runs"] and not pooled:
            raise SystemExit(f"error: --records {args.records}: it holds no run to report")
    else:
        data = {"runs": runner.load_runs(out) if out.is_dir() else []}
    if pooled:
        data["runs"] = runner.pool(runner.load_records(Path(pooled), "--pool-records"), data["runs"], pooled, out)
    if not data["runs"]:
        raise SystemExit(f"error: no finished runs in {out} (python tools/sweep.py run --grid {grid} --out-dir {out})")
    if pooled or not args.records:
        runs = data["runs"]
        data = compact(runs, out) if compact else runner.compact_runs(runs)
        # compact keeps the runs' order: its i-th run is the folder of runs[i] (a pooled one was checked when read)
        runner.refuse_non_finite(data["runs"], lambda run, i: str(out / runs[i]["name"]))
    s = analyse(data, args)
    write_report(Path(args.report_dir or out), s, private=private, table_md=table_md, plot=plot, records=data)
    return s
