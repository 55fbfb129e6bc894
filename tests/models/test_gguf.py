"""GGUF loading: exact dequantization for every tensor type, parity with the Hugging Face path and
with transformers' own GGUF loader, quantized weights kept quantized, and SmolLM2 answering."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedserve.config import cache_dir
from pagedserve.models.gguf import (GGUFError, find_gguf_file, gguf_source, hf_config_from_gguf, load_gguf_model,
                                    open_gguf, prepare_gguf_dir)
from pagedserve.models.gguf_index import GGUFTensorIndex
from pagedserve.models.llama import ModelArchitecture
from pagedserve.models.loader import resolve_model_dir
from pagedserve.kernels import native_ops
from pagedserve.models.gguf_linear import GGUFLinear
from pagedserve.models.quant import Int4Linear, Int8GroupedLinear, QuantizedEmbedding, weight_bytes
from tests.helpers.references import build_once, reference_path
from tests.models.gguf_files import hf_weights, reference_weight, write_gguf

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _load(path: Path, keep: bool, dtype=torch.float32, packed=False, native=True):
    """The model of a GGUF file (weights and metadata only: no tokenizer needed); ``native`` False
    loads it as a machine without the native kernels would."""
    arch = ModelArchitecture.from_hf_config(hf_config_from_gguf(open_gguf(path)))
    return load_gguf_model(path, arch, dtype, torch.device("cpu"), 64, "reference", keep_quantized=keep,
                           packed_for_cpu=packed, native_kernels=native)


def _weight(module, dtype=torch.float32) -> torch.Tensor:
    if hasattr(module, "dequantized_weight"):
        return module.dequantized_weight(dtype)
    return module.weight.detach().to(dtype)


@pytest.mark.parametrize("kind", TYPES)
def test_every_tensor_type_dequantizes_exactly(kind, tiny_ggufs, tiny_model_dir):
    """Kept quantized (float32 scales, portable layout) and dequantized, every weight equals the
    ``gguf`` package's own dequantization of the same blocks, bit for bit, in Hugging Face order."""
    path = tiny_ggufs(kind)
    hf = hf_weights(tiny_model_dir)
    ref = {k: reference_weight(v, kind) for k, v in hf.items()}
    quantized = kind.startswith("Q")
    for keep, native in ((True, True), (True, False), (False, True)):
        model = _load(path, keep, native=native)
        if keep and quantized and (native and native_ops() is not None):  # the GGUF blocks as they are
            assert isinstance(model.layers[0].self_attn.qkv_proj, GGUFLinear)
            assert model.layers[0].self_attn.qkv_proj.formats == [kind]
            assert isinstance(model.embed_tokens, QuantizedEmbedding)
        elif keep and kind in ("Q8_0", "Q4_0", "Q4_1"):  # no native kernels: the project's int8 / int4
            want = Int8GroupedLinear if kind == "Q8_0" else Int4Linear
            assert isinstance(model.layers[0].self_attn.qkv_proj, want)
            assert isinstance(model.embed_tokens, QuantizedEmbedding)
        elif quantized:  # dequantized
            assert type(model.layers[0].self_attn.qkv_proj) is torch.nn.Linear
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([ref[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
            assert torch.equal(_weight(layer.self_attn.qkv_proj), qkv)
            assert torch.equal(_weight(layer.self_attn.o_proj), ref[p + "self_attn.o_proj.weight"])
            gate_up = torch.cat([ref[p + "mlp.gate_proj.weight"], ref[p + "mlp.up_proj.weight"]])
            assert torch.equal(_weight(layer.mlp.gate_up_proj), gate_up)
            assert torch.equal(_weight(layer.mlp.down_proj), ref[p + "mlp.down_proj.weight"])
            assert torch.equal(layer.input_layernorm.weight, ref[p + "input_layernorm.weight"])
        assert torch.equal(_weight(model.lm_head), ref["lm_head.weight"])
        ids = torch.tensor([0, 5, 31999, 5])
        assert torch.equal(model.embed_tokens(ids).float(), ref["model.embed_tokens.weight"][ids])


@pytest.mark.parametrize("native", [True, False], ids=["gguf-kernels", "int8-int4-layers"])
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q5_0"])
def test_cpu_kernels_on_kept_weights_match_their_dequantized_matmul(kind, native, tiny_ggufs):
    if kind == "Q5_0" and not native:
        pytest.skip("without the native kernels Q5_0 is dequantized")
    fast = _load(tiny_ggufs(kind), keep=True, dtype=torch.bfloat16, packed=True, native=native)
    exact = _load(tiny_ggufs(kind), keep=True, dtype=torch.float32, packed=False)
    torch.manual_seed(0)
    for rows in (1, 5, 40):  # the grouped int8 layer's kernel loop, and its dequantized fallback
        x = torch.randn(rows, 64)
        for name in ("layers.0.self_attn.qkv_proj", "layers.1.mlp.gate_up_proj", "lm_head"):
            want = F.linear(x, exact.get_submodule(name).dequantized_weight(torch.float32))
            got = fast.get_submodule(name)(x.to(torch.bfloat16)).float()
            assert torch.allclose(got, want, atol=0.05 * want.abs().max().item(), rtol=0.02), (name, rows)


def test_prompt_chunks_take_the_gemm_of_the_compute_dtype_where_it_runs(tiny_ggufs):
    """gguf_gemm in the model's dtype: a bf16 model takes it where the CPU has AVX-512 BF16 (no AMX), a
    float32 one on every vector path; the integer kernels keep kernel_rows_default's rows for it."""
    from pagedserve.kernels import best_isa, gguf_gemm_usable
    from pagedserve.models.gguf_linear import GGUFLinear, kernel_rows_default, widest_format

    for dtype in (torch.float32, torch.bfloat16):
        layers = [m for m in _load(tiny_ggufs("Q4_1"), keep=True, dtype=dtype, packed=True).modules()
                  if isinstance(m, GGUFLinear)]
        want = gguf_gemm_usable(dtype)
        assert layers and all(m.gemm is want for m in layers), dtype
        assert all(m.kernel_rows == kernel_rows_default(best_isa(), dtype if want else None,
                                                        widest_format(m.formats, m.widths)) for m in layers)


def test_kept_weights_take_the_gguf_bytes(tiny_ggufs):
    """Q4_1 kept quantized on CPU (bf16 scales): every matrix's resident bytes are its GGUF bytes
    (0.625 B per weight); the only difference is the 1-D norms, F32 in the file and bf16 here."""
    path = tiny_ggufs("Q4_1")
    model = _load(path, keep=True, dtype=torch.bfloat16, packed=True)
    tensors = open_gguf(path).tensors
    matrices = sum(int(t.n_bytes) for t in tensors if len(t.shape) == 2)
    vectors = sum(int(t.n_elements) for t in tensors if len(t.shape) == 1)
    assert weight_bytes(model) == matrices + 2 * vectors


def test_the_engine_keeps_gguf_weights_quantized_unless_a_dtype_is_asked_for(tiny_ggufs):
    """load_model reads the request from the engine's config: ``--dtype auto`` keeps a GGUF's quantized
    tensors, an asked-for dtype (even the one auto computes in) dequantizes them."""
    from pagedserve.config import EngineConfig
    from pagedserve.models.loader import load_model

    model_dir = resolve_model_dir(str(tiny_ggufs("Q8_0", tokenizer=True)))
    arch = ModelArchitecture.from_hf_config(hf_config_from_gguf(open_gguf(gguf_source(model_dir))))
    kept, dequantized = (weight_bytes(load_model(model_dir, arch, torch.float32, torch.device("cpu"), EngineConfig(
        str(model_dir), dtype=dtype, max_model_len=64, attention_backend="reference"))) for dtype in ("auto", "float32"))
    assert kept < dequantized / 2  # Q8_0: about a byte per weight, float32 four


@pytest.mark.parametrize("kind,tokenizer", [(k, False) for k in TYPES] + [("Q8_0", True)])
def test_tensor_index_describes_the_file_as_the_full_reader(kind, tokenizer, tiny_ggufs):
    """The loader's index (no array parsing) has every tensor exactly as ``gguf.GGUFReader``: name,
    type, shape, sizes, offset and data; every scalar and string value; no array-valued key (with
    ``tokenizer``, the vocabulary's arrays sit before the tensors and must be stepped over exactly)."""
    from gguf import GGUFValueType

    path = tiny_ggufs(kind, tokenizer=tokenizer)
    index, full = GGUFTensorIndex(path), open_gguf(path)  # the full gguf.GGUFReader (cached for later tests)
    assert [t.name for t in index.tensors] == [t.name for t in full.tensors]
    for ours, theirs in zip(index.tensors, full.tensors):
        assert (ours.tensor_type, ours.shape.tolist(), ours.n_elements, ours.n_bytes, ours.data_offset) == \
            (theirs.tensor_type, theirs.shape.tolist(), theirs.n_elements, theirs.n_bytes, theirs.data_offset)
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert np.array_equal(ours.data, theirs.data), ours.name
    arrays = [k for k, f in full.fields.items() if f.types[0] == GGUFValueType.ARRAY]
    assert bool(arrays) == tokenizer and not set(arrays) & set(index.fields)
    scalars = {k: f.contents() for k, f in full.fields.items() if not k.startswith("GGUF.") and k not in arrays}
    assert {k: f.contents() for k, f in index.fields.items()} == scalars


def test_prepared_directory_and_tokenizer(tiny_ggufs, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    path = tiny_ggufs("Q8_0", tokenizer=True)
    model_dir = resolve_model_dir(str(path))
    assert model_dir == prepare_gguf_dir(path) and gguf_source(model_dir) == path.resolve()
    one = tmp_path / "one"
    one.mkdir()
    (one / "m.gguf").symlink_to(path)
    assert find_gguf_file(one) == one / "m.gguf"
    (one / "n.gguf").symlink_to(path)
    with pytest.raises(GGUFError, match="holds 2 GGUF files"):
        find_gguf_file(one)
    cfg = json.loads((model_dir / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["dtype"]) == (
        "llama", 2, 2, "bfloat16")
    ours, theirs = AutoTokenizer.from_pretrained(model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    for text in ["def parse(x):\n    return x  # ok", "naïve café ✓"]:
        assert ours.encode(text) == theirs.encode(text)
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_unsupported_architecture_and_type_are_one_line_errors(tiny_model_dir, tmp_path):
    import gguf

    bad_arch = write_gguf(tiny_model_dir, tmp_path / "phi.gguf", "F16", arch="phi3", tokenizer=False)
    with pytest.raises(GGUFError, match="unsupported GGUF architecture 'phi3'"):
        resolve_model_dir(str(bad_arch))
    # the failed preparation left no half-built directory in the cache (one was left per run before)
    assert not list((cache_dir() / "gguf").glob(f"phi-*.tmp{os.getpid()}"))
    # A tensor of a type nothing here can read (Q8_1), in an otherwise loadable file.
    src = gguf.GGUFReader(write_gguf(tiny_model_dir, tmp_path / "ok.gguf", "F32", tokenizer=False))
    w = gguf.GGUFWriter(str(tmp_path / "q81.gguf"), "llama")
    for name, field in src.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            w.add_key_value(name, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for t in src.tensors:
        if t.name == "blk.0.ffn_down.weight":
            n, k = int(t.shape[1]), int(t.shape[0])
            w.add_tensor(t.name, np.zeros((n, k // 32 * 40), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        else:
            w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(GGUFError, match=r"unsupported GGUF tensor type Q8_1 \(tensor 'blk.0.ffn_down.weight'\)"):
        _load(tmp_path / "q81.gguf", keep=True)


def _transformers_from_gguf(path: Path):
    """transformers' own GGUF loading (its dequantization and Q/K un-permutation), as a float32 model."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(prepare_gguf_dir(path))  # ours; transformers' parse would be a second one
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    model = AutoModelForCausalLM.from_config(config).float().eval()
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model


def _transformers_greedy(path: Path, load_model, prompt: list[int], steps: int) -> dict:
    """transformers' greedy tokens after ``prompt`` and each step's top-5 log-probabilities, from
    ``load_model()`` (its model of the file at ``path``): computed once per machine for the file's
    bytes, the prompt, the steps and the library versions (tests/helpers/references.py)."""
    def write(tmp: Path) -> None:
        with torch.no_grad():
            out = load_model().generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps,
                                        do_sample=False, output_logits=True, return_dict_in_generate=True)
        top = [step[0].float().log_softmax(-1).topk(5) for step in out.logits]
        torch.save({"tokens": out.sequences[0, len(prompt):].tolist(), "top_ids": [t.indices.tolist() for t in top],
                    "top_vals": [t.values for t in top]}, tmp)

    ref = reference_path(f"{path.stem}-greedy", path, format=1, suffix=".pt", prompt=prompt, steps=steps)
    return torch.load(build_once(ref, write))


def _assert_logprobs_match(out, ref: dict, atol: float) -> None:
    """Our engine's greedy tokens and top-5 log-probabilities against transformers' (:func:`_transformers_greedy`)."""
    assert out.outputs[0].token_ids == ref["tokens"]
    assert len(out.outputs[0].logprobs) == len(ref["top_ids"])
    for lp, top_ids, top_vals in zip(out.outputs[0].logprobs, ref["top_ids"], ref["top_vals"]):
        assert [t for t, _ in lp.top][:1] == top_ids[:1]
        assert torch.allclose(torch.tensor([v for _, v in lp.top]), top_vals, atol=atol)


@pytest.mark.parametrize("arch", ["llama", "llama-tied", "qwen2", "qwen3"])
def test_gguf_engine_matches_the_checkpoint_and_transformers(arch, checkpoint_dir, tiny_ggufs):
    """A float32 GGUF of each architecture: the same greedy tokens through the engine as the
    safetensors checkpoint it was written from, and log-probabilities matching transformers' own
    GGUF loader within 1e-4 (llama)."""
    from pagedserve.engine.frontend.llm import LLM
    from pagedserve.engine.sampling_params import SamplingParams

    src = checkpoint_dir(arch)
    path = tiny_ggufs("F32", src, arch, tokenizer=True)
    prompts = [[1, 17, 300 + i, 42, 9 * i + 5] for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    kw = dict(dtype="float32", kv_cache_memory="4MiB", attention_backend="reference")
    outs = LLM(str(path), **kw).generate(prompts, params)
    want = [o.outputs[0].token_ids for o in LLM(str(src), **kw).generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in outs] == want
    if arch == "llama":  # the Q/K un-permutation, checked against transformers' own (SmolLM2 checks it too)
        ref = _transformers_greedy(path, lambda: _transformers_from_gguf(path), prompts[0], params.max_tokens)
        _assert_logprobs_match(outs[0], ref, atol=1e-4)


# ---- SmolLM2-135M-Instruct, the default model (Q4_1 GGUF) ------------------------------------

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "What is 2 + 2?",
    "Write a haiku about the sea.", "What does a bee make?", "Give me a synonym for happy.",
    "How many legs does a spider have?", "What is the boiling point of water in Celsius?",
    "Translate 'thank you' into Spanish.", "What planet do we live on?", "Who wrote Hamlet?",
    "What color is the sky on a clear day?", "Name a fruit that is yellow.", "What is the opposite of cold?",
    "How many days are in a week?", "What is the largest ocean?",
]


@pytest.fixture(scope="module")
def smollm2_hf_dir(smollm2_gguf):
    """SmolLM2 dequantized by transformers' own GGUF loader, saved as an ordinary float32
    Hugging Face checkpoint (safetensors), with the prepared tokenizer. Built once per machine
    (tests/helpers/references.py): the dequantization takes transformers ~15 s."""
    import shutil

    def write(tmp: Path) -> None:
        _transformers_from_gguf(smollm2_gguf).save_pretrained(tmp, safe_serialization=True)
        for f in prepare_gguf_dir(smollm2_gguf).iterdir():
            if f.name.startswith(("tokenizer", "chat_template", "generation_config")):
                shutil.copy(f, tmp / f.name)

    return build_once(reference_path("smollm2-hf", smollm2_gguf, format=1), write)


def _chat_prompts(tokenizer) -> list[str]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in QUESTIONS]


@pytest.mark.slow
def test_smollm2_gguf_matches_the_dequantized_hf_checkpoint_and_transformers(smollm2_gguf, smollm2_hf_dir):
    """float32: the GGUF path (dequantized by our loader) and the Hugging Face path (transformers'
    dequantization, saved as safetensors) give identical greedy tokens for 16 chat prompts, and
    transformers' own model gives the same first-prompt logits and greedy tokens."""
    from pagedserve.engine.frontend.llm import LLM
    from pagedserve.engine.sampling_params import SamplingParams

    from transformers import AutoModelForCausalLM

    hf_dir = smollm2_hf_dir
    kw = dict(dtype="float32", kv_cache_memory="64MiB", max_model_len=256)
    params = SamplingParams(max_tokens=12, temperature=0)
    gguf_llm = LLM(str(smollm2_gguf), **kw)
    prompts = _chat_prompts(gguf_llm.engine.tokenizer)
    got = [o.outputs[0].token_ids for o in gguf_llm.generate(prompts, params)]
    ids = gguf_llm.engine.tokenize(prompts[0])
    out = gguf_llm.generate([ids], SamplingParams(max_tokens=6, temperature=0, logprobs=5))[0]
    del gguf_llm
    want = [o.outputs[0].token_ids for o in LLM(str(hf_dir), **kw).generate(prompts, params)]
    assert got == want
    ref = _transformers_greedy(smollm2_gguf, lambda: AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                               ids, steps=6)
    _assert_logprobs_match(out, ref, atol=2e-3)


@pytest.mark.slow
def test_smollm2_default_model_answers_and_keeps_q4_1_quantized(smollm2_gguf):
    """The default load (dtype auto): Q4_1 → int4, Q8_0 embedding → grouped int8 held once, no
    full-precision matrix; resident weight bytes within 1% of the GGUF's tensor bytes; "Paris"."""
    from pagedserve.engine.frontend.llm import LLM
    from pagedserve.engine.sampling_params import SamplingParams

    llm = LLM("SmolLM2-135M-Instruct", kv_cache_memory="32MiB", max_model_len=512)
    model = getattr(getattr(llm.engine, "runner", None), "model", None)
    info = json.loads((prepare_gguf_dir(smollm2_gguf) / "gguf_source.json").read_text())
    assert info["tensor_types"] == {"Q8_0": 1, "Q4_1": 210, "F32": 61}
    assert llm.engine.core.weight_bytes == pytest.approx(info["tensor_bytes"], rel=0.01)
    if model is not None:
        assert not any(type(m) is torch.nn.Linear for m in model.modules())
        assert model.lm_head is model.embed_tokens.table
    prompt = _chat_prompts(llm.engine.tokenizer)[0]
    text = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0].outputs[0].text
    assert "Paris" in text, text
