"""Decode on the default model (one stream, or --streams N together), a decode step's time split by
phase: the native decode stack and the LM head against the Python around them (scheduler, runner,
sampler, output processing), milliseconds per step, wall clock; then the decode stack's thread
pool's time (work_pool.h's PoolTimes): the caller in split jobs, waiting for a worker's last chunk,
in jobs of one chunk and between jobs (its own code: the step's Python, the stack's code between
kernels), and the workers busy or idle, in jobs and between them, which a sampling profiler does
not show (a sleeping worker takes no samples). The engine is set up as `bench compare`'s decode
worker sets it up (step threads pinned, no prefix cache, GC frozen after loading). docs/BENCHMARKS.md.

    python examples/native_decode_overhead.py [--model FILE] [--tokens 256] [--runs 3] [--streams 16 --prompt 64]
"""
import argparse
import gc
import os
import time
from collections import defaultdict

from pagedserve.engine.process_placement import bind_step_threads, usable_cores

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default=os.path.expanduser("~/.cache/pagedserve/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
parser.add_argument("--tokens", type=int, default=256, help="output tokens per run (16-token prompt)")
parser.add_argument("--runs", type=int, default=3, help="timed runs after one warm-up")
parser.add_argument("--streams", type=int, default=1, help="requests decoded together (1-64)")
parser.add_argument("--prompt", type=int, default=16, help="prompt tokens per request (1-512)")
args = parser.parse_args()
if not 1 <= args.streams <= 64 or not 1 <= args.prompt <= 512 or args.tokens < 2 or args.runs < 1:
    parser.error("--streams must be 1-64, --prompt 1-512, --tokens >= 2 and --runs >= 1")
threads = usable_cores()
bind_step_threads(threads)  # before torch loads, as the worker does

from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.engine.frontend.engine import Engine  # noqa: E402
from pagedserve.engine.sampling_params import SamplingParams  # noqa: E402
from pagedserve.models.native_decode import NativeDecode  # noqa: E402

engine = Engine(EngineConfig(model=args.model, num_threads=threads, enable_prefix_caching=False))
gc.collect()
gc.freeze()
spent: dict[str, float] = defaultdict(float)


def timed(owner, name: str, phase: str) -> None:
    call = getattr(owner, name)

    def wrapper(*a, **k):
        start = time.perf_counter()
        try:
            return call(*a, **k)
        finally:
            spent[phase] += time.perf_counter() - start

    setattr(owner, name, wrapper)


core = engine.core
timed(NativeDecode, "__call__", "native decode stack")
# The LM head: the stack's own, the head's screen or the Python head, whichever compute_logits takes.
timed(core.runner.model, "compute_logits", "LM head (compute_logits)")
timed(core.runner, "prepare", "runner.prepare")
timed(core.runner, "execute", "runner.execute (both native calls in it)")
timed(core.scheduler, "schedule", "scheduler.schedule")
timed(core.scheduler, "update_after_step", "scheduler.update_after_step")
timed(core.assembler, "finish_step", "sample and assemble")
timed(engine.output_processor, "process", "output processor")
params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)


native = core.runner.model.native_decode
pool: dict[str, int] = defaultdict(int)  # the stack's PoolTimes over the decode steps, and their wall clock
if native is not None:
    native.stack.count_pool_times(True)


def pool_times() -> dict[str, int]:
    return dict(native.stack.pool_times()) if native is not None else {}


def run() -> tuple[int, float]:
    """The requests' decode steps: their count and seconds. The prompts' step runs first, outside
    the clock and the split (a prefill, not a decode step: the Python layers and their GEMMs)."""
    for i in range(args.streams):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", [100 + (i + j) % 1000 for j in range(args.prompt)], params)
    before = dict(spent)
    engine.step()
    spent.clear()
    spent.update(before)
    times, steps, start = pool_times(), 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    seconds = time.perf_counter() - start
    for key, value in pool_times().items():
        if key != "threads":
            pool[key] += value - times[key]
    pool["seconds_ns"] += round(seconds * 1e9)
    return steps, seconds


run()
spent.clear()
pool.clear()
steps = total = 0.0
for _ in range(args.runs):
    n, seconds = run()
    steps, total = steps + n, total + seconds
print(f"{args.runs} runs of {args.streams} x {args.tokens} tokens, {threads} threads: {1e3 * total / steps:.3f} ms a "
      f"step, {steps / total:.1f} steps/s (decode steps; the prompts' step left out)")
for phase, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
    print(f"  {phase:42} {1e3 * seconds / steps:6.3f} ms")
in_native = spent["native decode stack"] + spent["LM head (compute_logits)"]
print(f"outside the native calls: {1 - in_native / total:.1%} of the time")
if native is None or pool["now"] <= 0 or pool_times()["threads"] < 2:
    print("the decode stack runs on no pool of its own here: no pool times")
else:
    per_step = pool["seconds_ns"] / pool["now"] / steps / 1e6  # ms a tick, a step's share
    workers = pool_times()["threads"] - 1
    ms = {key: pool[key] * per_step for key in ("now", "job", "caller_wait", "alone", "between", "worker_busy")}
    idle = workers * ms["now"] - ms["worker_busy"]
    in_jobs = workers * ms["job"] - ms["worker_busy"]
    print(f"the stack's pool, ms a step ({pool['jobs'] / steps:.0f} split jobs of {pool['chunks'] / max(pool['jobs'], 1):.1f} "
          f"chunks and {pool['alone_jobs'] / steps:.0f} of one a step):")
    print(f"  caller: in split jobs {ms['job']:.3f} (of which waiting for a worker's last chunk {ms['caller_wait']:.3f}), "
          f"jobs of one chunk {ms['alone']:.3f}, between jobs {ms['between']:.3f}")
    print(f"  {workers} worker{'s' if workers > 1 else ''}: busy {ms['worker_busy']:.3f}, idle {idle:.3f} "
          f"({idle / (workers * ms['now']):.1%}: in jobs {in_jobs:.3f}, between them {idle - in_jobs:.3f})")
