"""Small server-side SVG charts. Pure functions: numbers in, markup out; no JavaScript.

Every chart carries a <title> and an aria-label, and the templates show the same numbers in a
table beside it, so a screen reader or a text browser loses nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from django.utils.html import escape, format_html
from django.utils.safestring import SafeString, mark_safe

from loadgen.chart import nice_ceiling  # one axis rule for the CLI's charts and these

WIDTH, HEIGHT = 560, 260
LEFT, RIGHT, TOP, BOTTOM = 56, 24, 30, 44
# Colours by series position; modes keep stable colours through SERIES_ORDER.
SERIES_ORDER = ("cpu", "gpu", "hetero")


@dataclass(frozen=True)
class Frame:
    """Maps data to pixels inside the plot area."""

    x_min: float
    x_max: float
    y_max: float

    def x(self, value: float) -> float:
        span = self.x_max - self.x_min or 1.0
        return LEFT + (value - self.x_min) / span * (WIDTH - LEFT - RIGHT)

    def y(self, value: float) -> float:
        return HEIGHT - BOTTOM - value / (self.y_max or 1.0) * (HEIGHT - TOP - BOTTOM)


def _svg(template: str, *args: object) -> SafeString:
    """format_html with coordinates rounded to 0.1 px (format_html escapes, so it cannot)."""
    return format_html(template, *(f"{a:.1f}" if isinstance(a, float) else a for a in args))


def ticks(maximum: float, count: int = 5) -> list[float]:
    return [maximum * i / (count - 1) for i in range(count)]


def fmt(value: float) -> str:
    if value >= 100 or value == int(value):
        return f"{value:,.0f}"
    return f"{value:.3g}"


def colour_index(name: str, names: Sequence[str]) -> int:
    """Modes keep their colour across charts; other series are numbered in order."""
    for position, mode in enumerate(SERIES_ORDER):
        if name == mode or name.endswith(f" {mode}"):
            return position
    return len(SERIES_ORDER) + list(names).index(name)


def _open(title: str) -> list[str]:
    return [
        _svg(
            '<svg class="chart" viewBox="0 0 {} {}" role="img" aria-label="{}" '
            'xmlns="http://www.w3.org/2000/svg"><title>{}</title>',
            WIDTH,
            HEIGHT,
            title,
            title,
        )
    ]


def _axes(parts: list[str], frame: Frame, x_label: str, y_label: str) -> None:
    for value in ticks(frame.y_max):
        y = frame.y(value)
        parts.append(
            _svg(
                '<line class="grid" x1="{}" x2="{}" y1="{}" y2="{}"/>'
                '<text class="tick" x="{}" y="{}" text-anchor="end">{}</text>',
                LEFT,
                WIDTH - RIGHT,
                y,
                y,
                LEFT - 6,
                y + 4,
                fmt(value),
            )
        )
    parts.append(
        _svg(
            '<text class="axis-label" x="{}" y="{}" text-anchor="middle">{}</text>'
            '<text class="axis-label" x="14" y="{}" text-anchor="middle" '
            'transform="rotate(-90 14 {})">{}</text>',
            (LEFT + WIDTH - RIGHT) // 2,
            HEIGHT - 6,
            x_label,
            (TOP + HEIGHT - BOTTOM) // 2,
            (TOP + HEIGHT - BOTTOM) // 2,
            y_label,
        )
    )


def _legend(parts: list[str], names: Sequence[str]) -> None:
    x = LEFT + 8
    for name in names:
        parts.append(
            _svg(
                '<rect class="s{}" x="{}" y="{}" width="10" height="10"/>'
                '<text class="legend" x="{}" y="{}">{}</text>',
                colour_index(name, names),
                x,
                6,
                x + 14,
                15,
                name,
            )
        )
        x += 22 + 7 * len(name)


def line_chart(
    series: Mapping[str, Sequence[tuple[float, float]]],
    *,
    title: str,
    x_label: str,
    y_label: str,
) -> SafeString:
    """One polyline per series, points marked, x values labelled where they occur."""
    points = [p for values in series.values() for p in values]
    if not points:
        return SafeString("")
    xs = sorted({x for x, _ in points})
    x_max = xs[-1] if len(xs) > 1 else xs[0] + 1
    frame = Frame(xs[0], x_max, nice_ceiling(max(y for _, y in points)))
    parts = _open(title)
    _axes(parts, frame, x_label, y_label)
    for x in xs:
        parts.append(
            _svg(
                '<text class="tick" x="{}" y="{}" text-anchor="middle">{}</text>',
                frame.x(x),
                HEIGHT - BOTTOM + 16,
                fmt(x),
            )
        )
    names = list(series)
    for name, values in series.items():
        ordered = sorted(values)
        cls = colour_index(name, names)
        coords = " ".join(f"{frame.x(x):.1f},{frame.y(y):.1f}" for x, y in ordered)
        parts.append(_svg('<polyline class="line s{}" points="{}"/>', cls, coords))
        for x, y in ordered:
            parts.append(
                _svg(
                    '<circle class="s{}" cx="{}" cy="{}" r="3.5"><title>{}: {} at {}'
                    "</title></circle>",
                    cls,
                    frame.x(x),
                    frame.y(y),
                    name,
                    fmt(y),
                    fmt(x),
                )
            )
    _legend(parts, names)
    parts.append("</svg>")
    # Every piece above went through format_html, which escaped the data.
    return mark_safe("".join(parts))


def grouped_bar_chart(
    groups: Sequence[str],
    series: Mapping[str, Sequence[float | None]],
    *,
    title: str,
    y_label: str,
    x_label: str = "",
) -> SafeString:
    """Bars per group (e.g. p50/p90/p99), one bar per series (e.g. mode); None draws nothing."""
    values = [v for vals in series.values() for v in vals if v is not None]
    if not values or not groups:
        return SafeString("")
    frame = Frame(0, 1, nice_ceiling(max(values)))
    parts = _open(title)
    _axes(parts, frame, x_label, y_label)
    names = list(series)
    group_width = (WIDTH - LEFT - RIGHT) / len(groups)
    bar = group_width * 0.8 / max(1, len(names))
    for g, group in enumerate(groups):
        left = LEFT + g * group_width + group_width * 0.1
        parts.append(
            _svg(
                '<text class="tick" x="{}" y="{}" text-anchor="middle">{}</text>',
                left + group_width * 0.4,
                HEIGHT - BOTTOM + 16,
                group,
            )
        )
        for s, name in enumerate(names):
            value = series[name][g] if g < len(series[name]) else None
            if value is None:
                continue
            top = frame.y(value)
            parts.append(
                _svg(
                    '<rect class="s{}" x="{}" y="{}" width="{}" height="{}">'
                    "<title>{} {}: {}</title></rect>",
                    colour_index(name, names),
                    left + s * bar,
                    top,
                    max(bar - 2, 1),
                    HEIGHT - BOTTOM - top,
                    name,
                    group,
                    fmt(value),
                )
            )
    _legend(parts, names)
    parts.append("</svg>")
    return mark_safe("".join(parts))


def histogram_bins(values: Sequence[float], bins: int = 20) -> list[tuple[float, float, int]]:
    """(low, high, count) of equal-width bins over the values' range; the last bin is closed."""
    if not values:
        return []
    low, high = min(values), max(values)
    if high == low:
        return [(low, high, len(values))]
    width = (high - low) / bins
    counts = [0] * bins
    for value in values:
        counts[min(int((value - low) / width), bins - 1)] += 1
    return [(low + i * width, low + (i + 1) * width, counts[i]) for i in range(bins)]


def histogram(
    values: Sequence[float], *, title: str, x_label: str, name: str, bins: int = 20
) -> SafeString:
    edges = histogram_bins(values, bins)
    if not edges:
        return SafeString("")
    if len(edges) == 1:
        # Every value equal: one bar, one unit wide, centred on the value.
        value = edges[0][0]
        edges = [(value - 0.5, value + 0.5, edges[0][2])]
    # Counts are whole numbers: a multiple of four keeps every one of the five ticks whole.
    top_count = max(c for _, _, c in edges)
    frame = Frame(edges[0][0], edges[-1][1], float(max(4, math.ceil(top_count / 4) * 4)))
    parts = _open(title)
    _axes(parts, frame, x_label, "requests")
    cls = colour_index(name, [name])
    for low, high, count in edges:
        top = frame.y(count)
        parts.append(
            _svg(
                '<rect class="s{}" x="{}" y="{}" width="{}" height="{}">'
                "<title>{}-{} ms: {} requests</title></rect>",
                cls,
                frame.x(low),
                top,
                max(frame.x(high) - frame.x(low) - 1, 1.0),
                float(HEIGHT - BOTTOM) - top,
                fmt(low),
                fmt(high),
                count,
            )
        )
    middle = (edges[0][0] + edges[-1][1]) / 2
    for x, anchor in ((edges[0][0], "start"), (middle, "middle"), (edges[-1][1], "end")):
        parts.append(
            _svg(
                '<text class="tick" x="{}" y="{}" text-anchor="{}">{}</text>',
                frame.x(x),
                HEIGHT - BOTTOM + 16,
                anchor,
                fmt(x),
            )
        )
    parts.append("</svg>")
    return mark_safe("".join(parts))


def sparkline(values: Sequence[float], *, title: str, maximum: float = 100.0) -> SafeString:
    """A tiny line (e.g. CPU % over heartbeats), oldest first."""
    if len(values) < 2:
        return SafeString("")
    width, height = 240, 40
    step = width / (len(values) - 1)
    top = max(maximum, max(values)) or 1.0
    coords = " ".join(
        f"{i * step:.1f},{height - v / top * (height - 2) - 1:.1f}" for i, v in enumerate(values)
    )
    return _svg(
        '<svg class="spark" viewBox="0 0 {} {}" role="img" aria-label="{}" '
        'xmlns="http://www.w3.org/2000/svg"><title>{}</title>'
        '<polyline class="line s1" points="{}"/></svg>',
        width,
        height,
        title,
        title,
        escape(coords),
    )


def time_chart(
    series: Mapping[str, Sequence[tuple[float, float | None]]],
    *,
    title: str,
    y_label: str,
    span: float,
    x_label: str = "minutes ago",
) -> SafeString:
    """Lines over a time window: x is seconds before now (``-span`` .. 0), labelled in
    minutes (or hours past two hours); a None value breaks its line. Five ticks, not one a
    point, since a window holds dozens of points."""
    points = [(x, y) for values in series.values() for x, y in values if y is not None]
    if not points:
        return SafeString("")
    frame = Frame(-span, 0.0, nice_ceiling(max(y for _, y in points)))
    hours = span > 2 * 3600
    unit = 3600.0 if hours else 60.0
    parts = _open(title)
    _axes(parts, frame, "hours ago" if hours and x_label == "minutes ago" else x_label, y_label)
    for i in range(5):
        x = -span + span * i / 4
        parts.append(
            _svg(
                '<text class="tick" x="{}" y="{}" text-anchor="middle">{}</text>',
                frame.x(x),
                HEIGHT - BOTTOM + 16,
                fmt(round(-x / unit, 1) + 0.0),  # + 0.0: "0", not "-0", at now
            )
        )
    names = list(series)
    for name, values in series.items():
        cls = colour_index(name, names)
        runs: list[list[tuple[float, float]]] = [[]]
        for x, y in sorted(values, key=lambda p: p[0]):
            if y is None:
                runs.append([])
            else:
                runs[-1].append((x, y))
        for run in runs:
            if len(run) > 1:
                coords = " ".join(f"{frame.x(x):.1f},{frame.y(y):.1f}" for x, y in run)
                parts.append(_svg('<polyline class="line s{}" points="{}"/>', cls, coords))
            for x, y in run[-1:] if len(run) > 1 else run:
                parts.append(
                    _svg(
                        '<circle class="s{}" cx="{}" cy="{}" r="2.5"><title>{}: {} {}'
                        "</title></circle>",
                        cls,
                        frame.x(x),
                        frame.y(y),
                        name,
                        fmt(y),
                        y_label,
                    )
                )
    _legend(parts, names)
    parts.append("</svg>")
    # Every piece above went through format_html, which escaped the data.
    return mark_safe("".join(parts))
