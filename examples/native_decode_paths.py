"""The three decode paths of one engine alternated: the Python layers, the native stack on OpenMP
threads, the native stack on its own pool. N tokens, R rounds (environment). docs/BENCHMARKS.md."""
import os, time, torch, statistics
from pagedserve import LLM, SamplingParams
from pagedserve.models.native_decode import NativeDecode
path = os.path.expanduser("~/.cache/pagedserve/models/SmolLM2-135M-Instruct.Q4_1.gguf")
llm = LLM(path)
eng = llm.engine.core; model = eng.runner.model; kv = eng.runner.kv_caches
from pagedserve.kernels import native_ops
ops = native_ops()
paths = {"python": None, "native-omp": NativeDecode.build(model, kv, ops, threads=0)[0],
         "native-pool": NativeDecode.build(model, kv, ops)[0]}
N = int(os.environ.get("N", 64))
sp = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
res = {k: [] for k in paths}
for r in range(int(os.environ.get("R", 3))):
    for name, nd in paths.items():
        model.native_decode = nd
        t = time.perf_counter(); out = llm.generate(["Hello there, how are you today my friend?"], sp, use_tqdm=False)
        res[name].append(N / (time.perf_counter() - t))
for k, v in res.items(): print(k, "tok/s median", round(statistics.median(v), 1), [round(x, 1) for x in v])
