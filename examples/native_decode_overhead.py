"""Single-stream decode on the default model with the time inside the native decode calls measured:
the share of a step spent outside them (scheduler, runner, sampler, detokenizer). docs/BENCHMARKS.md."""
import os, time, statistics, torch
from pagedserve import LLM, SamplingParams
from pagedserve.models.native_decode import NativeDecode
path = os.path.expanduser("~/.cache/pagedserve/models/SmolLM2-135M-Instruct.Q4_1.gguf")
llm = LLM(path)
spent = [0.0]
call, logits = NativeDecode.__call__, NativeDecode.logits
def timed(f):
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); spent[0] += time.perf_counter() - t; return r
    return g
NativeDecode.__call__, NativeDecode.logits = timed(call), timed(logits)
N = 256
sp = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
prompt = "Hello there, how are you today my friend?"
llm.generate([prompt], sp, use_tqdm=False)
shares, rates = [], []
for _ in range(3):
    spent[0] = 0.0
    t = time.perf_counter(); llm.generate([prompt], sp, use_tqdm=False); total = time.perf_counter() - t
    rates.append(N / total); shares.append(1 - spent[0] / total)
print("tok/s", [round(r, 1) for r in rates], "median", round(statistics.median(rates), 1))
print("outside the native calls (prefill step included):", [f"{s:.1%}" for s in shares], "median", f"{statistics.median(shares):.1%}")
