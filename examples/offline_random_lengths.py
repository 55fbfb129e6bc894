"""The engine offline on W4b's lengths: 64 requests of random token ids, prompts U[216, 360] and
outputs U[108, 180] (vLLM's `random` dataset at 288 / 144 with range ratio 0.75) with
``ignore_eos``, all submitted at once. Prints output tokens/s: the figure a server's rate-inf
throughput is compared with (examples/serve_vs_vllm.sh).

TEMPERATURE defaults to 1.0 because that is what the served runs sample at: vLLM's `bench serve`
sends no temperature, so the server's default (the OpenAI API's 1.0) applies. 0 is greedy.

Usage: python examples/offline_random_lengths.py MODEL_DIR [DTYPE] [SEED] [TEMPERATURE]
"""

import sys
import time

from random_lengths import w4b_batch  # beside this file (the script's directory is on sys.path)

from pagedserve import LLM, SamplingParams


def main() -> None:
    model, dtype = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "float32"
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    temperature = float(sys.argv[4]) if len(sys.argv) > 4 else 1.0
    llm = LLM(model, dtype=dtype, kv_cache_memory="4GiB", max_num_seqs=64, max_model_len=4096)
    batch = w4b_batch(seed)
    prompts = [{"prompt_token_ids": ids} for ids, _ in batch]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=temperature) for _, n in batch]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{tokens} output tokens in {seconds:.1f} s: {tokens / seconds:.1f} output tok/s")


if __name__ == "__main__":
    main()
