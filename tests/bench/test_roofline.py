"""The decode roofline of ``bench compare``: the bytes a token reads from a GGUF file, the machine's
read bandwidth, and each engine's share of the ceiling they give."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFReader

from pagedserve.bench import compare
from pagedserve.bench.roofline import checkpoint_bytes_per_token, decode_bytes_per_token, read_bandwidth


def _tensor_bytes(t) -> int:
    """A tensor's bytes from its shape and type's block size, not from the reader's own count."""
    block, size = GGML_QUANT_SIZES[t.tensor_type]
    return int(np.prod([int(d) for d in t.shape])) // block * size


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_a_token_reads_every_tensor_but_an_untied_models_embedding_table(tiny_ggufs, kind):
    path = tiny_ggufs(kind)
    tensors = GGUFReader(str(path)).tensors
    names = {t.name for t in tensors}
    assert "output.weight" in names  # the tiny model's head is its own matrix: the table is looked up
    embedding = next(t for t in tensors if t.name == "token_embd.weight")
    want = sum(_tensor_bytes(t) for t in tensors) - _tensor_bytes(embedding)
    assert decode_bytes_per_token(path) == want > 0


def test_what_is_not_a_gguf_file_has_no_bytes_per_token(tmp_path, tiny_model_dir):
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    assert decode_bytes_per_token(text) is None
    assert decode_bytes_per_token(tiny_model_dir) is None  # a checkpoint directory
    assert decode_bytes_per_token(tmp_path / "missing.gguf") is None
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF")
    assert decode_bytes_per_token(truncated) is None
    empty = tmp_path / "empty.gguf"
    empty.touch()
    assert decode_bytes_per_token(empty) is None


def test_read_bandwidth_is_a_finite_rate_for_one_and_two_threads():
    for threads in (1, 2):
        rate = read_bandwidth(threads, buffer_bytes=4 << 20, reads=3)
        assert math.isfinite(rate) and rate > 1e8  # any machine reads 4 MiB faster than 100 MB/s


def test_the_ceiling_and_each_engines_share_of_it():
    decode = {"engines": {"pagedserve": {"median": 200.0}, "llama.cpp": {"median": 180.0}}}
    ceiling = compare.decode_ceiling(decode, bandwidth=28e9, token_bytes=100_000_000)
    assert ceiling["tok_s"] == pytest.approx(280.0)
    assert ceiling["shares"] == {"pagedserve": pytest.approx(200 / 280), "llama.cpp": pytest.approx(180 / 280)}
    line = compare.format_ceiling(ceiling)
    assert line == ("decode ceiling: 280.0 tok/s (the read bandwidth over 100.0 MB a token); "
                    "share of it: pagedserve 0.71, llama.cpp 0.64")


@pytest.mark.parametrize("tied", [False, True])
def test_a_checkpoint_token_reads_its_tensors_as_stored_but_an_untied_embedding_table(tmp_path, tied):
    import torch
    from safetensors.torch import save_file

    tensors = {"model.embed_tokens.weight": torch.zeros(100, 8, dtype=torch.bfloat16),
               "model.layers.0.mlp.down_proj.weight": torch.zeros(8, 16, dtype=torch.bfloat16),
               "model.norm.weight": torch.zeros(8, dtype=torch.float32)}
    if not tied:
        tensors["lm_head.weight"] = torch.zeros(100, 8, dtype=torch.bfloat16)
    save_file(dict(list(tensors.items())[:2]), str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(dict(list(tensors.items())[2:]), str(tmp_path / "model-00002-of-00002.safetensors"),
              metadata={"format": "pt"})
    want = 8 * 16 * 2 + 8 * 4 + 100 * 8 * 2  # tied: the table is the head; untied: the head, not the table
    assert checkpoint_bytes_per_token(tmp_path) == want
    # a greedy token through the head's screen: its int8 copy (a byte a weight, 8 bytes a row) instead
    assert checkpoint_bytes_per_token(tmp_path, head_screen=True) == want - 100 * 8 * 2 + 100 * 8 + 8 * 100


def test_what_is_no_checkpoint_has_no_bytes_per_token(tmp_path, tiny_ggufs):
    assert checkpoint_bytes_per_token(tmp_path) is None  # no safetensors file
    assert checkpoint_bytes_per_token(tiny_ggufs("Q8_0")) is None  # a file, not a directory
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    assert checkpoint_bytes_per_token(tmp_path) is None


def test_each_ceiling_takes_the_engines_that_read_its_bytes():
    decode = {"engines": {"pagedserve": {"median": 250.0}, "llama.cpp": {"median": 150.0},
                          "pagedserve-hf": {"median": 140.0}, "openvino": {"median": 143.5}}}
    gguf = compare.decode_ceiling(decode, 30e9, 100_000_000, {"pagedserve", "llama.cpp"})
    checkpoint = compare.decode_ceiling(decode, 30e9, 200_000_000, {"pagedserve-hf", "openvino"})
    assert set(gguf["shares"]) == {"pagedserve", "llama.cpp"} and gguf["tok_s"] == pytest.approx(300.0)
    assert checkpoint["shares"] == {"pagedserve-hf": pytest.approx(140 / 150), "openvino": pytest.approx(143.5 / 150)}
    assert compare.format_ceiling(checkpoint, "the checkpoint's decode ceiling") == (
        "the checkpoint's decode ceiling: 150.0 tok/s (the read bandwidth over 200.0 MB a token); "
        "share of it: pagedserve-hf 0.93, openvino 0.96")
