"""Plots of bench records: ``python -m bench plot RUN.json [RUN2.json ...] -o out.png``, and ``--plot``.

Size records (collectives, compressed, ...): one panel per op, time or bandwidth against size on
log-log axes with sizes in B/KiB/MiB, one line per peer (colour; dtype and device when they vary)
and per run (line style), the median round drawn with a band from the fastest to the slowest
round. ``bench train --curve`` records: loss against step, one line per optimizer and run.
``bench compressed --crossover`` records: time against size, one panel per setting.
matplotlib is an optional extra; without it :func:`matplotlib_missing` says how to install it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from .arguments import PLOT_Y, comma_list

__all__ = ["PLOT_Y", "matplotlib_missing", "size_label", "plot_records", "draw_records", "plot_curves",
           "plot_crossover", "load_runs", "main"]

_YLABEL = {"busbw_gbps": "bus bandwidth (GB/s)", "algbw_gbps": "algorithm bandwidth (GB/s)",
           "time_us_mean": "time per call (us)"}
_STYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v", "x")


def matplotlib_missing() -> str | None:
    """Return a message if matplotlib cannot be imported, else None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return ("plots need matplotlib, which is not installed: pip install matplotlib "
                "(or the 'plot' extra: pip install 'mpicomm[plot]')")
    return None


def size_label(n: float) -> str:
    """A tick label for a byte count: 8 B, 512 B, 1 KiB, 1.5 KiB, 64 MiB, 1 GiB."""
    from mpicomm import format_bytes

    return format_bytes(n).replace(".0 ", " ")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _band(rec: dict, y: str) -> tuple[float, float] | None:
    """The fastest and slowest round (or rank, without rounds) expressed in ``y``'s unit."""
    lo_t = rec.get("time_us_round_min", rec.get("time_us_min"))
    hi_t = rec.get("time_us_round_max", rec.get("time_us_max"))
    mean = rec.get("time_us_mean")
    if not lo_t or not hi_t or not mean:
        return None
    if y.startswith("time"):
        return lo_t, hi_t
    value = rec[y]
    return value * mean / hi_t, value * mean / lo_t  # bandwidth ~ 1 / time


def _variant(rec: dict, varying: Sequence[str]) -> str:
    return ", ".join(str(rec.get(k)) for k in varying)


def _key_legends(fig, peers: dict, variants: dict, runs: dict, varying: Sequence[str]) -> int:
    """Three small legends under the panels: colour = peer, line style = variant, marker = run.
    Returns the number of legend rows."""
    from matplotlib.lines import Line2D

    groups = [("peer (colour)", [Line2D([], [], color=c, linewidth=2) for c in peers.values()],
               list(peers))]
    if len(variants) > 1:
        groups.append((f"{', '.join(varying)} (line style)",
                       [Line2D([], [], color="black", linestyle=st) for st in variants.values()],
                       list(variants)))
    if len(runs) > 1:
        groups.append(("run (marker)",
                       [Line2D([], [], color="black", marker=m, linestyle=st)
                        for m, st in runs.values()], list(runs)))
    places = {1: ["lower center"], 2: ["lower left", "lower right"],
              3: ["lower left", "lower center", "lower right"]}[len(groups)]
    for (title, handles, labels), loc in zip(groups, places):
        fig.legend(handles, labels, loc=loc, title=title, ncol=min(3, len(labels)),
                   fontsize="small", title_fontsize="small", frameon=False,
                   bbox_to_anchor={"lower left": (0.02, 0), "lower right": (0.98, 0)}.get(loc))
    return max(-(-len(labels) // 3) for _, _, labels in groups) + 1


def _size_ticks(ax, sizes: Sequence[int]) -> None:
    """Labelled ticks at round powers of two (every 1, 2, 5 or 10 doublings: about 7 at most),
    unlabelled ones at every power of two."""
    from matplotlib.ticker import FixedLocator, NullFormatter

    lo, hi = min(sizes), max(sizes)
    exps = list(range(max(0, int(lo).bit_length() - 1), int(hi - 1).bit_length() + 1))
    step = next((s for s in (1, 2, 5, 10) if -(-len(exps) // s) <= 7), 10)
    major = [float(1 << e) for e in exps if e % step == 0] or [float(1 << exps[0])]
    ax.xaxis.set_major_locator(FixedLocator(major))
    ax.xaxis.set_minor_locator(FixedLocator([float(1 << e) for e in exps]))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(major, [size_label(t) for t in major], rotation=30, ha="right")


def plot_records(records: Sequence[dict], path: str, *, y: str = "busbw_gbps",
                 title: str = "") -> None:
    """Draw ``y`` (a record field or a PLOT_Y name) against size, one panel per op; save a PNG."""
    fig = draw_records(records, y=y, title=title)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)


def draw_records(records: Sequence[dict], *, y: str = "busbw_gbps", title: str = ""):
    """The figure of :func:`plot_records` (the caller saves and closes it).

    Records may carry ``"run"`` (which file or program run they come from). Colour tells the
    peer, line style the dtype/device (where those vary), the marker the run.
    """
    y = PLOT_Y.get(y, y)
    recs = [r for r in records if "size_bytes" in r and y in r]
    if not recs:
        raise ValueError(f"plot: no records with 'size_bytes' and {y!r} to draw")
    plt = _pyplot()
    varying = [k for k in ("dtype", "device") if len({r.get(k) for r in recs}) > 1]
    run_names = list(dict.fromkeys(str(r.get("run", "")) for r in recs))
    variant_names = list(dict.fromkeys(_variant(r, varying) for r in recs))
    peers = {p: f"C{i % 10}" for i, p in enumerate(
        dict.fromkeys(str(r.get("peer") or r["op"]) for r in recs))}
    variants = {v: _STYLES[i % len(_STYLES)] for i, v in enumerate(variant_names)}
    runs = {name: (_MARKERS[i % len(_MARKERS)],
                   _STYLES[i % len(_STYLES)] if len(variants) == 1 else "-")
            for i, name in enumerate(run_names)}
    panels: dict[str, dict[tuple[str, str, str], list[dict]]] = {}
    for r in recs:
        line = (str(r.get("run", "")), str(r.get("peer") or r["op"]), _variant(r, varying))
        panels.setdefault(str(r["op"]), {}).setdefault(line, []).append(r)
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.9 * rows + 1.2), squeeze=False)
    for ax, (op, lines) in zip(axes.flat, panels.items()):
        drawn_sizes = []
        for (run, peer, variant), points in lines.items():
            points = sorted((p for p in points if p[y] > 0), key=lambda p: p["size_bytes"])
            if not points:
                continue
            xs = [p["size_bytes"] for p in points]
            drawn_sizes += xs
            marker, run_style = runs[run]
            style = variants[variant] if len(variants) > 1 else run_style
            ax.plot(xs, [p[y] for p in points], color=peers[peer], linestyle=style,
                    marker=marker, markersize=3.5, linewidth=1.4)
            bands = [_band(p, y) for p in points]
            if all(b is not None for b in bands):
                ax.fill_between(xs, [b[0] for b in bands], [b[1] for b in bands],
                                color=peers[peer], alpha=0.12, linewidth=0)
        ax.set_title(op)
        if not drawn_sizes:
            ax.text(0.5, 0.5, f"no positive {y}\n(busbw is 0 on one rank: try --y algbw)",
                    ha="center", va="center", transform=ax.transAxes)
            continue
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        _size_ticks(ax, drawn_sizes)
        ax.set_xlabel("message size")
        ax.set_ylabel(_YLABEL.get(y, y))
        ax.grid(True, which="major", alpha=0.35)
        ax.grid(True, which="minor", axis="y", alpha=0.12)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    legend_rows = _key_legends(fig, peers, variants, runs, varying)
    band_note = "line: median round; band: fastest to slowest round"
    fig.suptitle(f"{title}\n{band_note}" if title else band_note, fontsize="medium")
    fig.tight_layout(rect=(0, min(0.4, 0.3 * legend_rows / (3.9 * rows + 1.2)), 1, 1))
    return fig


def plot_curves(records: Sequence[dict], path: str, *, title: str = "") -> None:
    """Draw loss against step for ``bench train --curve`` records; save a PNG."""
    curves = [r for r in records if r.get("op") == "curve" and r.get("losses")]
    if not curves:
        raise ValueError("plot: no loss curves ('op': 'curve' records) to draw")
    plt = _pyplot()
    runs = list(dict.fromkeys(str(r.get("run", "")) for r in curves))
    peers = list(dict.fromkeys(r["peer"] for r in curves))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in curves:
        ri = runs.index(str(r.get("run", "")))
        label = r.get("label", r["peer"]) + (f" [{r.get('run')}]" if len(runs) > 1 else "")
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=label,
                color=f"C{peers.index(r['peer']) % 10}", linestyle=_STYLES[ri % len(_STYLES)])
        if r.get("freeze_step"):
            ax.axvline(r["freeze_step"] + 0.5, color="grey", linestyle=":", linewidth=1,
                       label=f"{r['peer']} compresses from step {r['freeze_step'] + 1}")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title(title or "loss against step", fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_crossover(records: Sequence[dict], path: str, *, title: str = "") -> None:
    """Time per call against size for ``bench compressed --crossover`` records, one panel per
    setting: fp32 and each 1-bit API, crossovers marked; save a PNG."""
    results = [r for r in records if r.get("op") == "crossover" and r.get("sizes")]
    if not results:
        raise ValueError("plot: no crossovers ('op': 'crossover' records) to draw")
    plt = _pyplot()
    settings = list(dict.fromkeys(r["setting"] for r in results))
    cols = min(2, len(settings))
    rows = -(-len(settings) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.6 * cols, 3.6 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(settings):]:
        ax.set_visible(False)
    for ax, setting in zip(flat, settings):
        mine = [r for r in results if r["setting"] == setting]
        ax.plot(mine[0]["sizes"], mine[0]["fp32_us"], "o-", color="black", label="fp32 all_reduce")
        for r, colour in zip(mine, ("tab:blue", "tab:orange")):
            ax.plot(r["sizes"], r["onebit_us"], "s--", color=colour, label=f"1-bit {r['api']}")
            if r["crossover_bytes"] is not None:
                ax.axvline(r["crossover_bytes"], color=colour, alpha=0.4, lw=3)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = mine[0]["sizes"][::max(1, len(mine[0]["sizes"]) // 4)]
        ax.set_xticks(ticks, [size_label(t) for t in ticks])
        ax.set_title(setting, fontsize=9)
        ax.set_xlabel("message size per rank")
        ax.grid(True, which="both", alpha=0.3)
    for row in axes:
        row[0].set_ylabel("time per call (us), lower is better")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title or "1-bit vs fp32 allreduce (vertical band: 1-bit faster from there on)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_runs(paths: Sequence[str]) -> list[dict]:
    """Read saved JSON runs; each record gets ``run``: the file's name (its path if names clash),
    with the run's rank count and network."""
    names = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    records = []
    for path, name in zip(paths, names):
        label = name if names.count(name) == 1 else path
        try:
            with open(path) as f:
                doc = json.load(f)
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not JSON: {exc}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("records"), list):
            raise ValueError(f"{path}: expected a bench JSON file "
                             '({"meta": {...}, "records": [...]}), got something else')
        meta = doc.get("meta") or {}
        if isinstance(meta, dict) and meta.get("ranks"):
            label += f" ({meta['ranks']} ranks, {meta.get('network') or 'local'})"
        records += [dict(r, run=label) for r in doc["records"] if isinstance(r, dict)]
    return records


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench plot",
        description="Draw saved bench JSON runs side by side (log-log, one panel per op).")
    parser.add_argument("runs", nargs="+", metavar="RUN.json", help="files written with --json")
    parser.add_argument("-o", "--output", required=True, metavar="OUT.png", help="PNG to write")
    parser.add_argument("--y", choices=sorted(PLOT_Y), default="busbw",
                        help="what to draw against size (default busbw)")
    parser.add_argument("--ops", type=comma_list(), default=None,
                        help="comma list of ops to draw (default all)")
    parser.add_argument("--title", default="", help="a title above the panels")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    problem = matplotlib_missing()
    if problem:
        print(f"bench plot: {problem}", file=sys.stderr)
        return 2
    try:
        records = load_runs(args.runs)
        if args.ops:
            wanted = set(args.ops)
            records = [r for r in records if r.get("op") in wanted]
        if any(r.get("op") == "crossover" for r in records):
            plot_crossover(records, args.output, title=args.title)
        elif any(r.get("op") == "curve" for r in records):
            plot_curves(records, args.output, title=args.title)
        else:
            plot_records(records, args.output, y=args.y, title=args.title)
    except ValueError as exc:
        print(f"bench plot: {exc}", file=sys.stderr)
        return 2
    print(f"plot written to {args.output} ({len(records)} records from {len(args.runs)} run(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
