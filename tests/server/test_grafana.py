"""docs/grafana/pagedserve.json is what ``pagedserve grafana`` generates, and every metric its
panels' queries name is in a live scrape of the real server."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.server.grafana import render

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "pagedserve.json"
# A series selector in the generated queries: a metric name followed by its label matcher.
_METRIC = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{")


def test_committed_dashboard_is_the_generated_one() -> None:
    assert DASHBOARD.read_text() == render(), "regenerate it: pagedserve grafana"


def test_every_queried_metric_exists_in_a_live_scrape(server_url: str, model_name: str) -> None:
    # One finished request first: labelled series (finish reasons, ...) appear once something has
    # finished, and the shared server may not have served anything yet when this runs alone.
    done = httpx.post(f"{server_url}/v1/completions", json={"model": model_name, "prompt": "grafana", "max_tokens": 2},
                      timeout=60)
    assert done.status_code == 200, done.text
    text = httpx.get(f"{server_url}/metrics", timeout=10).text
    samples = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert len(panels) >= 20
    for panel in panels:
        for target in panel["targets"]:
            names = _METRIC.findall(target["expr"])
            assert names, target["expr"]
            for name in names:
                assert name in samples, f"panel {panel['title']!r} queries {name}, which /metrics lacks"
