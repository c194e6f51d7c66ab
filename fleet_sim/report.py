"""The simulator's outputs: a text table, JSON lines, and a plot (matplotlib PNG when it is installed,
else one self-contained HTML page of inline SVG charts)."""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLUMNS = (
    ("engines", "engines", "{:d}"),
    ("policy", "policy", "{}"),
    ("store_gib", "store GiB", "{}"),
    ("hit_rate", "hit %", "{:.1%}"),
    ("local_hit_rate", "local %", "{:.1%}"),
    ("store_hit_rate", "store %", "{:.1%}"),
    ("ttft_p50_s", "TTFT p50 s", "{:.3f}"),
    ("ttft_p90_s", "TTFT p90 s", "{:.3f}"),
    ("prefix_reuse", "reuse %", "{:.1%}"),
    ("imbalance", "imbal", "{:.2f}"),
    ("throughput_tok_s", "out tok/s", "{:.0f}"),
    ("bytes_moved_per_request", "MB moved/req", "{:.1f}"),
    ("wall_s", "sim s", "{:.1f}"),
)
# with --oracle, after TTFT p90 (absent keys: the column is left out)
ORACLE_COLUMNS = (
    ("oracle_p90_s", "oracle p90 s", "{:.3f}"),
    ("bound_p90_s", "bound p90 s", "{:.3f}"),
    ("p90_vs_bound", "x bound", "{:.2f}"),
)

CHARTS = (
    ("hit_rate", "hit rate (local + store)", 100.0, "%"),
    ("ttft_p50_s", "TTFT p50", 1.0, "s"),
    ("ttft_p90_s", "TTFT p90", 1.0, "s"),
    ("throughput_tok_s", "throughput (output tokens/s)", 1.0, ""),
    ("bytes_moved_per_request", "bytes moved per request", 1e-6, "MB"),
)


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    v = row.get(key)
    if key == "bytes_moved_per_request":
        v = v / 1e6
    if key == "store_gib":
        return "off" if v == 0 else ("inf" if math.isinf(v) else f"{v:g}")
    try:
        return fmt.format(v)
    except (ValueError, TypeError):
        return str(v)


def table(rows: Sequence[dict[str, Any]]) -> str:
    at = [k for k, _, _ in COLUMNS].index("ttft_p90_s") + 1
    columns = [*COLUMNS[:at], *(c for c in ORACLE_COLUMNS if any(c[0] in r for r in rows)), *COLUMNS[at:]]
    cells = [[title for _, title, _ in columns]]
    cells += [[_cell(r, key, fmt) for key, _, fmt in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def json_line(row: dict[str, Any]) -> str:
    def clean(v: Any) -> Any:
        return None if isinstance(v, float) and math.isnan(v) else ("inf" if v == math.inf else v)

    return json.dumps({k: clean(v) for k, v in row.items()})


def capacity_for(
    rows: Sequence[dict[str, Any]], fraction: float = 0.9
) -> list[tuple[int, str, float, float]]:
    """For each (engines, policy) swept over store capacities including inf: the smallest store GiB
    whose hit rate reaches `fraction` of the unbounded one (linear between the swept points), and the
    unbounded hit rate. NaN when no finite point reaches it."""
    out = []
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["engines"], r["policy"]), []).append(r)
    for (engines, policy), rs in groups.items():
        inf = [r for r in rs if math.isinf(r["store_gib"])]
        pts = sorted((r["store_gib"], r["hit_rate"]) for r in rs if not math.isinf(r["store_gib"]))
        if not inf or not any(x > 0 for x, _ in pts):
            continue  # no finite store swept
        target = fraction * inf[0]["hit_rate"]
        gib = math.nan
        prev = None
        for x, y in pts:
            if y >= target:
                gib = (
                    x
                    if prev is None or y == prev[1]
                    else prev[0] + (x - prev[0]) * (target - prev[1]) / (y - prev[1])
                )
                break
            prev = (x, y)
        out.append((engines, policy, gib, inf[0]["hit_rate"]))
    return out


def _series(rows: Sequence[dict[str, Any]], x: str, group: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        label = ", ".join(f"{g}={_cell(r, g, '{}')}" for g in group)
        out.setdefault(label, []).append(r)
    for rs in out.values():
        rs.sort(key=lambda r: r[x])
    return out


_PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def _svg_chart(series: dict[str, list[tuple[float, float]]], title: str, xlabel: str, unit: str) -> str:
    W, H, L, R, T, B = 460, 300, 60, 150, 28, 40
    pts = [p for s in series.values() for p in s if math.isfinite(p[1])]
    if not pts:
        return ""
    xs = sorted({p[0] for p in pts})
    logx = xs[0] > 0 and xs[-1] / xs[0] > 20
    fx = (lambda v: math.log10(v)) if logx else (lambda v: v)
    x0, x1 = fx(xs[0]), fx(xs[-1])
    y1 = max(p[1] for p in pts) * 1.1 or 1.0
    sx = lambda v: L + (fx(v) - x0) / ((x1 - x0) or 1) * (W - L - R)  # noqa: E731
    sy = lambda v: H - B - v / y1 * (H - T - B)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
             f'<text x="{L}" y="16" font-size="13" font-weight="bold">{html.escape(title)}</text>',
             f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="#444"/>',
             f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="#444"/>']  # fmt: skip
    for v in xs:
        parts.append(f'<text x="{sx(v):.1f}" y="{H - B + 14}" text-anchor="middle">{v:g}</text>')
    parts.append(f'<text x="{(L + W - R) / 2}" y="{H - 6}" text-anchor="middle">{html.escape(xlabel)}</text>')
    for i in range(5):
        v = y1 * i / 4
        parts.append(f'<text x="{L - 4}" y="{sy(v) + 4:.1f}" text-anchor="end">{v:.3g}{unit}</text>')
        parts.append(f'<line x1="{L}" y1="{sy(v):.1f}" x2="{W - R}" y2="{sy(v):.1f}" stroke="#eee"/>')
    for k, (label, s) in enumerate(series.items()):
        color = _PALETTE[k % len(_PALETTE)]
        good = [(x, y) for x, y in s if math.isfinite(y)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in good)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for x, y in good:
            parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}"/>')
        ly = T + 14 * k
        parts.append(f'<rect x="{W - R + 8}" y="{ly}" width="10" height="3" fill="{color}"/>')
        parts.append(f'<text x="{W - R + 22}" y="{ly + 5}">{html.escape(label)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _figures(
    rows: Sequence[dict[str, Any]],
) -> list[tuple[str, str, dict[str, list[tuple[float, float]]], str, float, str]]:
    """(x key, title, {label: points}, x label, scale, unit) for each chart worth drawing."""
    figs = []
    by_engines = _series(
        [r for r in rows if len({x["engines"] for x in rows}) > 1], "engines", ("policy", "store_gib")
    )
    finite_store = [r for r in rows if not math.isinf(r["store_gib"]) and r["store_gib"] > 0]
    by_store = _series(
        finite_store if len({r["store_gib"] for r in finite_store}) > 1 else [],
        "store_gib",
        ("policy", "engines"),
    )
    for key, title, scale, unit in CHARTS:
        if by_engines:
            pts = {label: [(r["engines"], r[key] * scale) for r in rs] for label, rs in by_engines.items()}
            figs.append((key, f"{title} vs engines", pts, "engines", scale, unit))
        if by_store:
            pts = {label: [(r["store_gib"], r[key] * scale) for r in rs] for label, rs in by_store.items()}
            figs.append((key, f"{title} vs store GiB", pts, "store GiB (shared tier)", scale, unit))
    return figs


def write_plot(rows: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    """A PNG (matplotlib) when `path` ends in .png and matplotlib is installed, else an HTML page."""
    figs = _figures(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".png":
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            path = path.with_suffix(".html")
        else:
            n = max(len(figs), 1)
            fig, axes = plt.subplots((n + 1) // 2, 2, figsize=(12, 3.5 * ((n + 1) // 2)), squeeze=False)
            for ax, (_, t, pts, xl, _, unit) in zip(axes.flat, figs, strict=False):
                for label, s in pts.items():
                    ax.plot([p[0] for p in s], [p[1] for p in s], marker="o", label=label)
                ax.set_title(t)
                ax.set_xlabel(xl)
                ax.set_ylabel(unit)
                if len({p[0] for s in pts.values() for p in s}) > 2:
                    ax.set_xscale("log")
                ax.legend(fontsize=7)
            fig.suptitle(title)
            fig.tight_layout()
            fig.savefig(path)
            return path
    charts = "\n".join(_svg_chart(pts, t, xl, unit) for _, t, pts, xl, _, unit in figs)
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
        f"<body style='font-family:sans-serif'><h2>{html.escape(title)}</h2>\n{charts}\n"
        f"<pre>{html.escape(table(rows))}</pre></body></html>\n"
    )
    path.write_text(page)
    return path
