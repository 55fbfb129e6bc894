"""OpenVINO GenAI's decode tokens/s on a Hugging Face checkpoint: one greedy request through
``LLMPipeline.generate`` on the CPU, or with ``--requests`` W1's output tokens/s through its
``ContinuousBatchingPipeline``, every request submitted at once (run with the venv-openvino Python
by ``pagedserve bench compare``; prints one JSON line). The checkpoint is exported to OpenVINO IR
once, into ``--ir``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from peer_timing import arguments, batch_rate, decode_rate, prompt_ids, read_requests, report


def export_once(model: str, ir: Path) -> None:
    """optimum-cli's export (weights in its default precision, tokenizers included), renamed into
    place when complete so that an interrupted export is redone."""
    if (ir / "openvino_model.xml").exists():
        return
    part = ir.with_name(ir.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    cli = Path(sys.executable).with_name("optimum-cli")
    subprocess.run([str(cli), "export", "openvino", "--model", model, "--task", "text-generation-with-past", str(part)],
                   check=True, stdout=sys.stderr)  # stdout carries only the result line
    os.replace(part, ir)


def main() -> None:
    p = arguments(__doc__)
    p.add_argument("--ir", required=True, help="directory of the exported model (made once)")
    p.add_argument("--kv-precision", default=None, choices=["u8", "bf16", "f16", "f32"],
                   help="KV_CACHE_PRECISION (default: the CPU plugin's own, u8)")
    args = p.parse_args()
    props = {"INFERENCE_NUM_THREADS": args.threads}
    if args.kv_precision is not None:
        props["KV_CACHE_PRECISION"] = args.kv_precision
    export_once(args.model, Path(args.ir))
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    def greedy(max_tokens: int):
        config = ov_genai.GenerationConfig()
        config.max_new_tokens, config.ignore_eos, config.do_sample = max_tokens, True, False
        return config

    if args.requests:  # W1: 64 seats and a 2,048-token budget, as pagedserve's on CPU; 4 GiB of KV
        prompts, outputs = read_requests(args.requests)
        scheduler = ov_genai.SchedulerConfig()
        scheduler.cache_size, scheduler.max_num_seqs, scheduler.max_num_batched_tokens = 4, 64, 2048
        scheduler.dynamic_split_fuse = True
        batch = ov_genai.ContinuousBatchingPipeline(args.ir, scheduler, "CPU", props)

        def generate_all(ids: list[list[int]], max_tokens: list[int]) -> None:
            batch.generate([ov.Tensor(np.array([p], dtype=np.int64)) for p in ids], [greedy(n) for n in max_tokens])

        report(batch_rate(generate_all, prompts, outputs))
        return
    pipe = ov_genai.LLMPipeline(args.ir, "CPU", **props)
    tokenizer = pipe.get_tokenizer()
    ids = prompt_ids(lambda text: tokenizer.encode(text).input_ids.data[0].tolist(), args.prompt)

    def generate(prompt: list[int], max_tokens: int) -> None:
        pipe.generate(ov.Tensor(np.array([prompt], dtype=np.int64)), greedy(max_tokens))

    report(decode_rate(generate, ids, args.output))


if __name__ == "__main__":
    main()
