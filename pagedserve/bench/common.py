"""Shared bits of the offline benchmarks: model choice, engine runs with timing, result files."""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch


def resolve_model(model: str | None, default: str = "small") -> str:
    """A directory or hub id as given, or a standard model name (tiny, small, qwen05-shape) built locally."""
    from pagedserve.models.standard import STANDARD_MODELS, ensure_standard_model

    name = model or default
    return str(ensure_standard_model(name)) if name in STANDARD_MODELS else name


def machine_summary() -> str:
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


@dataclass
class RunTimes:
    """Wall time of an engine run, plus per-step samples taken by a callback."""

    seconds: float = 0.0
    samples: list = field(default_factory=list)


def run_engine(engine, requests, params_for, on_step=None, progress=None) -> tuple[dict, RunTimes]:
    """Add every request at once and step to completion; returns outputs by id and timing."""
    for i, req in enumerate(requests):
        engine.add_request(str(i), req.prompt_token_ids, params_for(req))
    outputs, times = {}, RunTimes()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
                if progress is not None:
                    progress.update(1)
        if on_step is not None:
            times.samples.append(on_step(engine, time.perf_counter() - start))
    times.seconds = time.perf_counter() - start
    return outputs, times


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def greedy_streams(engine, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    """Decode tokens/s of greedy requests run together (the tokens after every one has its first,
    over the time after that), and each one's tokens."""
    from pagedserve.engine.sampling_params import SamplingParams

    for i, prompt_ids in enumerate(prompts):
        engine.add_request(f"stream{i}", prompt_ids, SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True))
    first_at, first_tokens, tokens = None, 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
        if first_at is None and len(tokens) == len(prompts) and all(tokens.values()):
            first_at, first_tokens = time.perf_counter(), sum(map(len, tokens.values()))
    generated = sum(map(len, tokens.values())) - first_tokens
    return generated / (time.perf_counter() - first_at), [tokens[f"stream{i}"] for i in range(len(prompts))]


def greedy_stream(engine, prompt_ids: list[int], output_len: int) -> tuple[float, list[int]]:
    """Decode tokens/s (after the first token) of one greedy request run alone, and its tokens."""
    rate, tokens = greedy_streams(engine, [prompt_ids], output_len)
    return rate, tokens[0]


def write_result(path: str | None, result: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2))


def median_call_us(fn, calls: int) -> float:
    """Microseconds of one call of ``fn``: the median of ``calls`` timed calls after one warm-up
    (its first-call allocations are not timed)."""
    import statistics
    import time

    fn()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def percentiles(values: list[float], scale: float = 1.0) -> dict[str, float]:
    """p50/p95/p99 and mean, scaled (e.g. 1000 for ms); NaN when there is nothing to measure."""
    if not values:
        return {"p50": math.nan, "p95": math.nan, "p99": math.nan, "mean": math.nan}
    a = np.asarray(values) * scale
    return {"p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}
