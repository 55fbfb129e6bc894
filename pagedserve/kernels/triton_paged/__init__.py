"""Paged-attention kernels in Triton, for the GPU: the ``triton`` attention backend's kernels.

* :mod:`.pools` — how a kernel addresses one layer's K (or V) pool: any of the engine's layouts
  (head-major float pools, token-major quantized pools with their scales, plain tensors) as a
  base tensor and three strides, so one kernel reads them all.
* :mod:`.kv_write` — this step's K and V stored by slot mapping (quantized on the way for int8 /
  fp8 pools, exactly as :func:`pagedserve.kv.quant.quantize_kv` does); negative slots are skipped,
  which is how a CUDA graph's padding rows write nothing.
* :mod:`.decode` — one query token per sequence, K and V read in place through the block table,
  the query heads that share a KV head computed together (GQA), the context split over several
  programs (split-K) and merged by a second kernel when it is long.
* :mod:`.prefill` — prompt chunks of any length (varlen) against their whole context: causal
  inside the chunk, the cached prefix (a prefix-cache hit, earlier chunks) seen in full.

* :mod:`.paged_tiles` — a tile of K or V read through a block table (shared by both).
* :mod:`.availability` — whether the kernels can run on a device, asked without importing Triton.

Triton is an optional dependency (``pip install pagedserve[triton]``); nothing outside the
``triton`` backend (:mod:`pagedserve.models.triton_attention`) imports the kernel modules (the
engine asks :mod:`.availability`, which imports no Triton). The tests
run the same kernels on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before
the first import), in float32 and float16 over float, int8 and fp8 pools; bf16 compute and fp8
writes are checked on a GPU only (the interpreter does not round them as the card does).
"""
