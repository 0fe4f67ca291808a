"""The dashboard's pure calculations: topology layout, chart geometry, run figures."""

from __future__ import annotations

from controlplane.dashboard import benchdata, charts
from controlplane.dashboard.topology import Holder, build_topology


def test_numa_nodes_are_split_over_sockets_and_cores_marked_by_holder() -> None:
    numa = [(i, f"{i * 4}-{i * 4 + 3}", 8 * 1024**3) for i in range(4)]
    layout = build_topology(
        numa, 2, [Holder("dep CPU engine", "2-9"), Holder("dep GPU engine", "9,40")]
    )
    assert [[n.index for n in s.numa] for s in layout.sockets] == [[0, 1], [2, 3]]
    cores = {c.cpu: c for s in layout.sockets for n in s.numa for c in n.cores}
    assert layout.cpu_count == 16
    assert [cpu for cpu, c in cores.items() if c.holders == [0]] == [2, 3, 4, 5, 6, 7, 8]
    assert cores[9].shared and cores[9].labels == ["dep CPU engine", "dep GPU engine"]
    assert layout.unplaced == [40]  # a stale plan naming a CPU the node does not have
    assert [h.cores for h in layout.holders] == [8, 1]


def test_a_bad_cpuset_is_reported_not_raised() -> None:
    layout = build_topology([(0, "0-3", 0)], 1, [Holder("x", "3-1")])
    assert layout.holders[0].error and layout.holders[0].cores == 0


def test_nice_axis_maximum() -> None:
    assert [charts.nice_ceiling(v) for v in (0, 0.7, 3, 7.2, 99, 101, 620)] == [
        1.0,
        1.0,
        5.0,
        10.0,
        100.0,
        200.0,
        1000.0,
    ]


def test_histogram_bins_count_every_value_once() -> None:
    values = [1.0, 2.0, 2.5, 9.9, 10.0]
    bins = charts.histogram_bins(values, bins=3)
    assert sum(count for _, _, count in bins) == len(values)
    assert bins[-1][2] == 2  # the last bin is closed: 10.0 lands in it
    assert charts.histogram_bins([5.0, 5.0], bins=4) == [(5.0, 5.0, 2)]


def test_charts_escape_their_labels_and_skip_empty_data() -> None:
    svg = charts.line_chart(
        {"<b>": [(1, 10.0), (4, 30.0)]}, title="t & t", x_label="x", y_label="y"
    )
    assert "<b>" not in svg and "&lt;b&gt;" in svg and "t &amp; t" in svg
    assert charts.line_chart({}, title="t", x_label="x", y_label="y") == ""
    assert charts.grouped_bar_chart(["p50"], {"gpu": [None]}, title="t", y_label="y") == ""
    assert charts.histogram([], title="t", x_label="x", name="gpu") == ""


def _row(mode: str, concurrency: int, throughput: float, completed: int = 4) -> dict:
    dist = {"mean": 10.0, "median": 9.0, "p90": 12.0, "p99": 15.0}
    return {
        "mode": mode,
        "concurrency": concurrency,
        "summary": {
            "completed": completed,
            "failed": 0,
            "output_throughput": throughput,
            "ttft": dist,
            "tpot": dist,
            "e2e": dist,
        },
    }


def test_figures_from_the_load_generators_summary() -> None:
    summary = {"rows": [_row("hetero", 4, 600.0), _row("cpu", 1, 30.0), {"mode": "bad"}]}
    figures = benchdata.figures_from_summary(summary)
    assert [(f.mode, f.concurrency) for f in figures] == [("cpu", 1), ("hetero", 4)]
    assert benchdata.throughput_series(figures) == {"cpu": [(1.0, 30.0)], "hetero": [(4.0, 600.0)]}
    assert benchdata.percentile_series(figures, "ttft") == {"hetero": [9.0, 12.0, 15.0]}
    assert benchdata.figures_from_summary({"rows": "nonsense"}) == []
    # A level where nothing completed has no throughput, rather than zero.
    (empty,) = benchdata.figures_from_summary({"rows": [_row("gpu", 2, 0.0, completed=0)]})
    assert empty.throughput is None


def test_figures_from_samples_use_the_wall_span() -> None:
    samples = [
        benchdata.SampleRow("gpu", 2, True, 100, 50.0, 5.0, 1000.0, 0.0),
        benchdata.SampleRow("gpu", 2, True, 100, 70.0, 6.0, 1000.0, 1.0),
        benchdata.SampleRow("gpu", 2, False, 0, None, None, None, 1.5),
    ]
    (figures,) = benchdata.figures_from_samples(samples)
    assert figures.completed == 2 and figures.failed == 1
    assert figures.throughput == 100.0  # 200 tokens over the 2 s from first send to last end
    assert figures.ttft["median"] == 60.0
