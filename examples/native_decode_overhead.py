"""Single-stream decode on the default model, a decode step's time split by phase: the native decode
stack and the LM head against the Python around them (scheduler, runner, sampler, output processing),
milliseconds per step, wall clock. The engine is set up as `bench compare`'s decode worker sets it
up (step threads pinned, no prefix cache, GC frozen after loading). docs/BENCHMARKS.md.

    python examples/native_decode_overhead.py [--model FILE] [--tokens 256] [--runs 3]
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
args = parser.parse_args()
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


def run() -> tuple[int, float]:
    """One request's decode steps: their count and seconds. The prompt's step runs first, outside
    the clock and the split (a prefill, not a decode step: the Python layers and their GEMMs)."""
    engine.add_request(f"r{time.monotonic_ns()}", list(range(100, 116)), params)
    before = dict(spent)
    engine.step()
    spent.clear()
    spent.update(before)
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps, time.perf_counter() - start


run()
spent.clear()
steps = total = 0.0
for _ in range(args.runs):
    n, seconds = run()
    steps, total = steps + n, total + seconds
print(f"{args.runs} runs of {args.tokens} tokens, {threads} threads: {1e3 * total / steps:.3f} ms a step, "
      f"{steps / total:.1f} steps/s (decode steps; the prompt's step left out)")
for phase, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
    print(f"  {phase:42} {1e3 * seconds / steps:6.3f} ms")
native = spent["native decode stack"] + spent["LM head (compute_logits)"]
print(f"outside the native calls: {1 - native / total:.1%} of the time")
