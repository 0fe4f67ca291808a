"""An SVG chart of a goodput sweep: SLO attainment and throughput against request rate.

Two panels side by side, one line per mode in each, the attainment target drawn as a dashed
line. Plain SVG text with no dependency, so the terminal writes it as a file and the
dashboard embeds the same markup on a run's page.
"""

from __future__ import annotations

import math
from html import escape

from loadgen.goodput import GoodputSearch

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
_W, _H = 360, 240  # one panel
_PAD_L, _PAD_R, _PAD_T, _PAD_B = 56, 12, 28, 40


def nice_ceiling(value: float) -> float:
    """The smallest 1, 2, 2.5 or 5 x 10^n at or above ``value`` (a readable axis maximum)."""
    if value <= 0 or not math.isfinite(value):
        return 1.0
    exponent = math.floor(math.log10(value))
    for step in (1.0, 2.0, 2.5, 5.0, 10.0):
        candidate: float = step * 10.0**exponent
        if candidate >= value * (1 - 1e-9):
            return candidate
    return 10.0 ** (exponent + 1)


def _panel(
    x0: float,
    title: str,
    y_max: float,
    y_label: str,
    rates: list[float],
    series: list[tuple[str, str, list[tuple[float, float]]]],
    target: float | None,
) -> list[str]:
    left, top = x0 + _PAD_L, _PAD_T
    width, height = _W - _PAD_L - _PAD_R, _H - _PAD_T - _PAD_B
    x_max = max(rates) if rates else 1.0

    def px(rate: float) -> float:
        return left + width * rate / x_max

    def py(value: float) -> float:
        return top + height * (1 - min(value, y_max) / y_max)

    out = [
        f'<text x="{left + width / 2:.1f}" y="16" text-anchor="middle" '
        f'font-weight="bold">{escape(title)}</text>',
        f'<rect x="{left}" y="{top}" width="{width}" height="{height}" fill="none" stroke="#999"/>',
    ]
    for i in range(5):
        value = y_max * i / 4
        y = py(value)
        out.append(f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{value:g}</text>')
    for rate in rates:
        out.append(
            f'<text x="{px(rate):.1f}" y="{top + height + 14}" text-anchor="middle">{rate:g}</text>'
        )
    out.append(
        f'<text x="{left + width / 2:.1f}" y="{_H - 6}" text-anchor="middle">'
        "request rate (req/s)</text>"
    )
    out.append(
        f'<text transform="translate({x0 + 12},{top + height / 2:.1f}) rotate(-90)" '
        f'text-anchor="middle">{escape(y_label)}</text>'
    )
    if target is not None:
        y = py(target)
        out.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{left + width}" y2="{y:.1f}" '
            'stroke="#555" stroke-dasharray="4 3"/>'
        )
    for _mode, colour, points in series:
        if not points:
            continue
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for x, y in points:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{colour}"/>')
    return out


def sweep_svg(searches: dict[str, GoodputSearch], title: str = "") -> str:
    """The chart of every mode's sweep as one SVG document."""
    rates = sorted({point.rate for search in searches.values() for point in search.points})
    colours = {mode: PALETTE[i % len(PALETTE)] for i, mode in enumerate(searches)}
    attainment = [
        (mode, colours[mode], [(p.rate, p.attainment) for p in search.points])
        for mode, search in searches.items()
    ]
    throughput = [
        (mode, colours[mode], [(p.rate, p.throughput) for p in search.points])
        for mode, search in searches.items()
    ]
    tp_max = nice_ceiling(max((y for _, _, pts in throughput for _, y in pts), default=1.0))
    target = next(iter(searches.values())).target if searches else None
    legend_y = _H + 8
    height = legend_y + 18 * ((len(searches) + 2) // 3) + (18 if title else 4)
    body = [
        *_panel(0, "SLO attainment (%)", 100.0, "attainment (%)", rates, attainment, target),
        *_panel(_W, "output throughput", tp_max, "tokens/s", rates, throughput, None),
    ]
    for i, mode in enumerate(searches):
        x, y = 60 + (i % 3) * 220, legend_y + 12 + 18 * (i // 3)
        search = searches[mode]
        best = search.max_goodput_rate
        label = f"{mode}: max goodput {best:g} req/s" if best is not None else f"{mode}: none"
        body.append(
            f'<rect x="{x}" y="{y - 9}" width="12" height="4" fill="{colours[mode]}"/>'
            f'<text x="{x + 16}" y="{y}">{escape(label)}</text>'
        )
    if title:
        body.append(
            f'<text x="{_W}" y="{height - 4}" text-anchor="middle" fill="#555">'
            f"{escape(title)}</text>"
        )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * _W}" height="{height}" '
        f'viewBox="0 0 {2 * _W} {height}" font-family="sans-serif" font-size="11">'
        + "".join(body)
        + "</svg>\n"
    )
