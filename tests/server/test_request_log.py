"""``serve --log-requests``: one parsable line per finished request, joined on the client's request id."""

from __future__ import annotations

import httpx

from pagedserve.bench.tiers import read_request_log


def test_each_finished_request_is_logged_once_with_its_timings(interval_log_server) -> None:  # type: ignore[no-untyped-def]
    # The session's --log-requests server (shared with the stream-interval test): only the lines
    # of this test's request ids (log-*) are this test's.
    url, log_path = interval_log_server.url, interval_log_server.log_path
    with httpx.Client(base_url=url, timeout=60) as http:
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 5, "ignore_eos": True, "temperature": 0}
        with http.stream("POST", "/v1/completions", json={**body, "stream": True, "request_id": "log-stream"}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data:")]
        assert r.status_code == 200 and events[-1] == "data: [DONE]"
        r = http.post("/v1/completions", json={**body, "request_id": "log-plain", "priority": 3})
        assert r.status_code == 200
        r = http.post("/v1/completions", json={**body, "prompt": [], "request_id": "log-refused"})
        assert r.status_code == 400
        assert http.get("/load").json()["kv_blocks_used"] == 0
    text = log_path.read_text()
    lines = [line for line in text.splitlines() if "pagedserve.requests" in line and "request log-" in line]
    assert len(lines) == 2, text  # the refused request never ran: no line
    plain = next(line for line in lines if "log-plain" in line)
    assert "priority=3 reason=length prompt_tokens=4 output_tokens=5 cached_tokens=" in plain
    timings = {rid: t for rid, t in read_request_log(log_path).items() if rid.startswith("log-")}
    assert set(timings) == {"log-stream", "log-plain"}
    for t in timings.values():
        # the way to the core and the queue time are parts of TTFT, which counts from the front
        # handing the request to the core
        assert t.to_core is not None and 0 <= t.to_core and 0 <= t.queue and t.to_core + t.queue <= t.ttft < 30
