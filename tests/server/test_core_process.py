"""The engine core in its own process, tried as a hostile client would: a request that breaks a
step fails alone, the core's death ends every open stream at once and the server exits non-zero,
huge prompts never stall /health, n beyond the seats is a 400."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pagedserve.bench.processes import free_port, running_process
from tests.helpers.waiting import wait_until
from tests.helpers.servers import core_pid, wait_for_idle

ARGS = ("--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "512", "--log-level", "warning")


def _serve(model_dir: Path, *extra: str, entry: tuple[str, ...] = ("pagedserve", "serve")) -> tuple[list[str], str]:
    port = free_port()
    cmd = [sys.executable, "-m", *entry, "--host", "127.0.0.1", "--port", str(port),
           "--model", str(model_dir), *ARGS, *extra]
    return cmd, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def fault_process(tiny_model_dir) -> Iterator[tuple[str, subprocess.Popen]]:  # type: ignore[no-untyped-def, type-arg]
    """(URL, process) of a server whose core raises in any step batching a request whose id starts
    with 'poison'. The module's last test that uses it kills its core (the server then exits)."""
    # `pagedserve serve` with the fault tests' core factory (tests/helpers/faults.py): the real
    # server, front end and core process, the core's step raising for those requests alone.
    cmd, url = _serve(tiny_model_dir, "--max-body-bytes", "8MiB", entry=("tests.helpers.faults", "execute", "poison"))
    with running_process(cmd, f"{url}/health", timeout_s=300) as proc:
        yield url, proc


@pytest.fixture(scope="module")
def fault_server(fault_process) -> str:  # type: ignore[no-untyped-def]
    return fault_process[0]


def test_the_front_end_runs_without_torch_and_the_core_with_it(fault_process):
    """A served front end never loads torch (nor transformers, which would import it): its start
    would cost seconds of CPU more. Checked on the live processes' memory maps, before any request
    (a structured-output request loads xgrammar, which imports torch, in the front)."""
    url, proc = fault_process
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200

    def maps(pid: int) -> str:
        return Path(f"/proc/{pid}/maps").read_text()

    assert "libtorch" in maps(core_pid(proc.pid))  # the check can see torch where it is
    assert "libtorch" not in maps(proc.pid)


def _stream(url: str, body: dict) -> tuple[str | None, list[str]]:
    """Stream a completion; (the error event's message or None, the raw data lines)."""
    lines = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
    error = next((json.loads(x)["error"]["message"] for x in lines if x.startswith('{"error"')), None)
    return error, lines


def _texts(url: str, n: int, prefix: str) -> dict[str, str]:
    def one(i: int) -> tuple[str, str]:
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "prompt": f"request number {i} says", "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "request_id": f"{prefix}-{i}"})
        assert r.status_code == 200, r.text
        return f"{i}", r.json()["choices"][0]["text"]
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return dict(pool.map(one, range(n)))


def test_a_request_that_breaks_its_step_fails_alone(fault_server):
    clean = _texts(fault_server, 8, "clean")
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        others = pool.submit(_texts, fault_server, 8, "again")
        poisoned = pool.submit(httpx.post, f"{fault_server}/v1/completions", timeout=60, json={
            "prompt": "x y z", "max_tokens": 16, "request_id": "poison-plain"})
        streamed = pool.submit(_stream, fault_server, {"prompt": "x y z", "max_tokens": 16,
                                                       "request_id": "poison-stream"})
        assert others.result() == clean  # the rest of the batch: identical output
        r = poisoned.result()
        assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed", r.text
        message, lines = streamed.result()
        assert isinstance(message, str) and "injected" in message and lines[-1] == "[DONE]"
    assert wait_for_idle(fault_server)["kv_blocks_used"] == 0
    assert httpx.get(f"{fault_server}/health", timeout=5).status_code == 200


def test_more_completions_than_seats_is_a_400(fault_server):
    r = httpx.post(f"{fault_server}/v1/completions", timeout=30, json={"prompt": "x", "max_tokens": 3, "n": 100})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert "max_num_seqs" in r.json()["error"]["message"]


# The /health prober runs in a process of its own: in this one, late in the suite, a full garbage
# collection over the test run's heap (set off by parsing the two 500k-token answers) pauses every
# thread for up to ~2 s, which is the client's stall, not the server's.
_PROBE = """
import json, sys, time, httpx
latencies = []
with httpx.Client(base_url=sys.argv[1], timeout=10) as http:
    print("ready", flush=True)
    while sys.stdin.readline().strip() == "probe":
        t0 = time.perf_counter()
        assert http.get("/health").status_code == 200
        latencies.append(time.perf_counter() - t0)
        print("ok", flush=True)
print(json.dumps(latencies), flush=True)
"""


def test_health_stays_fast_while_huge_prompts_are_tokenized(fault_server):
    """On the server the fault tests above just used. (The body's text check once looped over the
    characters in Python on the event loop: each 3.9 MB body held /health for up to ~2 s.)"""
    big = "word " * 780_000  # 3.9 MB
    prober = subprocess.Popen([sys.executable, "-c", _PROBE, fault_server], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert prober.stdout.readline().strip() == "ready"
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            jobs = [pool.submit(httpx.post, f"{fault_server}/tokenize", json={"prompt": big}, timeout=120)
                    for _ in range(2)]
            refused = pool.submit(httpx.post, f"{fault_server}/v1/completions", json={"prompt": big, "max_tokens": 4},
                                  timeout=60)
            probes = 0  # from at once: the loop runs until both tokenizations are done
            while not all(j.done() for j in jobs) and probes < 2000:
                prober.stdin.write("probe\n")
                prober.stdin.flush()
                assert prober.stdout.readline().strip() == "ok"
                probes += 1
                time.sleep(0.01)
            counts = [j.result().json()["count"] for j in jobs]
            assert refused.result().status_code == 400
        out, _ = prober.communicate("stop\n", timeout=30)
    finally:
        prober.kill()
    latencies = json.loads(out.strip().splitlines()[-1])
    assert counts[0] == counts[1] > 500_000
    assert len(latencies) >= 20, "tokenizing finished before /health could be probed"
    p99 = statistics.quantiles(latencies, n=100)[98]
    worst = sorted(latencies)[-5:]
    assert p99 < 0.05, f"/health p99 {p99 * 1000:.1f} ms while tokenizing (n={len(latencies)}, worst {worst})"


def test_killing_the_core_ends_every_stream_within_a_second_and_the_server_exits_non_zero(fault_process):
    url, proc = fault_process  # the fault tests above are done with it: this one ends it
    body = {"prompt": "tell me a long story", "max_tokens": 400, "ignore_eos": True}
    streamed: dict[int, list[str]] = {}
    ended: dict[int, float] = {}
    with httpx.Client(timeout=30) as http, concurrent.futures.ThreadPoolExecutor(3) as pool:
        def consume(i: int) -> list[str]:
            lines = streamed.setdefault(i, [])
            with http.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
            ended[i] = time.monotonic()
            return lines
        futures = [pool.submit(consume, i) for i in range(3)]
        wait_until(lambda: len(streamed) == 3 and all(len(lines) >= 2 for lines in streamed.values()),
                   timeout=60, what="every stream producing tokens")
        os.kill(core_pid(proc.pid), signal.SIGKILL)
        killed = time.monotonic()
        results = [f.result(timeout=10) for f in futures]
    for lines in results:
        assert lines[-1] == "[DONE]" and '"engine_unavailable"' in lines[-2], lines[-3:]
    assert max(ended.values()) - killed < 1.0
    # Never a 200 again: 503 while it drains, then nothing listens.
    while proc.poll() is None:
        try:
            assert httpx.get(f"{url}/health", timeout=2).status_code == 503
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    assert proc.wait(timeout=30) == 1


def test_the_default_model_answers_a_real_question(smollm2_server):
    """`pagedserve serve` with no --model (the session's default-model server): SmolLM2-135M-Instruct
    knows the capital of France, and streams the answer it gives whole.

    The stream is compared with a whole answer taken in the same prefix-cache state (both after the
    first request cached the prompt's blocks): a hit runs the prompt's last tokens through the
    integer kernels, a cold prompt of more rows than GGUFLinear gives them (kernel_rows_default:
    32, or 128 on AVX-512 VNNI, or in float32 the format's own, FLOAT32_KERNEL_ROWS) through a GEMM, and where the two first tokens lie
    within ~0.1 of each other (QUANTIZATION.md) the two paths may pick differently (seen on a Zen 5
    computing in bf16 with 32). Where the whole prompt fits the kernels' rows, cold and cached take
    the same path, and the cached answer must be the cold one."""
    import openai
    import torch

    from pagedserve.kernels import best_isa, cpu_has_native_bf16, gguf_gemm_usable
    from pagedserve.models.gguf_linear import kernel_rows_default

    with openai.OpenAI(base_url=f"{smollm2_server}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
        question = [{"role": "user", "content": "What is the capital of France?"}]
        cold = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question,
                                              max_tokens=24, temperature=0)
        assert "Paris" in cold.choices[0].message.content
        answer = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question,
                                                max_tokens=24, temperature=0)
        dtype = torch.bfloat16 if cpu_has_native_bf16() else torch.float32  # the server's --dtype auto
        # the default file's layers are Q4_1
        if cold.usage.prompt_tokens <= kernel_rows_default(str(best_isa()), dtype if gguf_gemm_usable(dtype) else None,
                                                           "Q4_1"):
            assert answer.choices[0].message.content == cold.choices[0].message.content
        chunks = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question,
                                                max_tokens=24, temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == answer.choices[0].message.content
    assert wait_for_idle(smollm2_server)["kv_blocks_used"] == 0


def test_the_core_does_not_outlive_a_killed_server(tiny_model_dir):
    cmd, url = _serve(tiny_model_dir)
    with running_process(cmd, f"{url}/health", timeout_s=300) as proc:
        core = core_pid(proc.pid)
        with httpx.Client(timeout=30) as http, http.stream("POST", f"{url}/v1/completions", json={
                "prompt": "a long answer", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
            next(r.iter_lines())  # the core is busy generating
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{core}").exists() and b"zombie" not in _state(core) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{core}").exists() or b"zombie" in _state(core), "orphaned engine core"


def _state(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/status").read_bytes().split(b"\n")[2].lower()  # "State:\tZ (zombie)"
    except OSError:
        return b"zombie"
