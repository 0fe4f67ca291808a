"""One tiny scenario of the live matrix end to end: two simulators, two routers, the load
generator, then the virtual model beside it."""

from __future__ import annotations

import pytest

from hetero.live import MatrixRun, run_matrix, targets
from hetero.matrix import MatrixScenario
from testbed.vllm_env import connector_config

pytestmark = pytest.mark.process


def test_one_scenario_live_and_virtual() -> None:
    scenario = MatrixScenario(
        id="tiny", pair="a10-xeon", shape="balanced", input_tokens=64, output_tokens=32,
        slo_ttft_ms=3000, slo_tpot_ms=100, rates=(2.0, 4.0, 8.0), knee=3.0,
    )  # fmt: skip
    seen = []
    run = MatrixRun(
        requests=6, steady=False, speed=20.0, connector=connector_config, on_cell=seen.append
    )
    cells = run_matrix([scenario], run)
    assert seen == cells and [c.rate for c in cells] == [2.0, 4.0, 8.0]
    for cell in cells:
        assert cell.live is not None
        for mode in ("gpu", "hetero"):
            assert cell.live[mode].requests == 6 and cell.virtual[mode].requests == 6
            # A light load at a loose SLO: every request meets it, live and virtual.
            assert cell.live[mode].attainment == 100.0, cell.live
            # Which route served each request, live and virtual, for a newcomer comparing
            # the two; nothing missed, and the generator's lateness is measured.
            for side in (cell.live[mode], cell.virtual[mode]):
                assert sum(side.routes.values()) == 6 and side.misses == {}, side
            assert cell.live[mode].late_p99_ms is not None
        # GPU-only mode: every request on the GPU, live and virtual, for the same reason.
        live_routes, virtual_routes = cell.live["gpu"].routes, cell.virtual["gpu"].routes
        assert live_routes == virtual_routes and all(
            r.startswith("gpu-only") for r in live_routes
        ), (live_routes, virtual_routes)
        assert cell.error() is not None and cell.error() < 0.01
    no_harm = next(t for t in targets(cells) if t.name.startswith("no harm"))
    assert no_harm.met
