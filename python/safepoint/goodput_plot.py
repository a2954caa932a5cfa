"""Plots goodput against the checkpoint interval (``safepoint simulate --plot``).

``python -m safepoint.goodput_plot CSV PNG [--measured INTERVAL GOODPUT] [--title TEXT]``

The CSV is what ``safepoint simulate --csv`` writes: a column ``interval_seconds`` and one
column of expected goodput per strategy, in full precision, with each strategy's interval of the
model's plan among the points (src/advisor/plan.h, GoodputCurve). Each strategy's curve is drawn
on a logarithmic interval axis with its highest point marked, which is that interval, labelled
the way ``safepoint simulate`` and ``safepoint advise`` print it (``_core.format_duration``): one
model, one answer. ``--measured`` adds a measured point (the validation in docs/benchmarks.md).
The numbers all come from the C++ model; this module only draws them.
"""

from __future__ import annotations

import argparse
import csv
import sys


def read_curves(path: str) -> tuple[list[float], dict[str, list[float]]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows or rows[0][0] != "interval_seconds":
        raise ValueError(f"{path}: not a goodput CSV (no interval_seconds column)")
    names = rows[0][1:]
    xs = [float(r[0]) for r in rows[1:]]
    curves = {n: [float(r[i + 1]) for r in rows[1:]] for i, n in enumerate(names)}
    return xs, curves


def format_duration(seconds: float) -> str:
    """The interval as the CLI prints it ('0.164 s', '3.5 min')."""
    try:
        from safepoint import _core

        return str(_core.format_duration(seconds))
    except ImportError:  # the module alone, without the package's extension
        return f"{seconds:.3g} s"


def optimum(xs: list[float], ys: list[float]) -> int:
    """The index of the curve's highest point (the first of equal ones)."""
    return max(range(len(ys)), key=ys.__getitem__)


def plot(csv_path: str, png_path: str, measured: list[float] | None = None,
         title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs, curves = read_curves(csv_path)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for i, (name, ys) in enumerate(curves.items()):
        (line,) = ax.plot(xs, [100 * y for y in ys], label=name)
        best = optimum(xs, ys)
        ax.plot([xs[best]], [100 * ys[best]], "o", color=line.get_color())
        ax.annotate(f"{100 * ys[best]:.2f}% at {format_duration(xs[best])}",
                    (xs[best], 100 * ys[best]),
                    textcoords="offset points", xytext=(6, -14 - 12 * i), fontsize=8,
                    color=line.get_color())
    if measured:
        ax.plot([measured[0]], [100 * measured[1]], "k*", markersize=12, label="measured")
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval (s)")
    ax.set_ylabel("goodput (%)")
    lows = [min(v for v in ys if v > 0) for ys in curves.values() if any(v > 0 for v in ys)]
    ax.set_ylim(max(0.0, 100 * min(lows) - 5) if lows else 0, 100)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title(title or "Expected goodput against checkpoint interval")
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m safepoint.goodput_plot")
    p.add_argument("csv")
    p.add_argument("png")
    p.add_argument("--measured", nargs=2, type=float, metavar=("INTERVAL", "GOODPUT"))
    p.add_argument("--title")
    a = p.parse_args(argv)
    try:
        plot(a.csv, a.png, a.measured, a.title)
    except (OSError, ValueError) as e:
        print(f"safepoint.goodput_plot: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
