"""The real-model paths of ``bench quality`` and ``bench retrieval`` on the tiny model and a tiny corpus:
prose extraction, a GGUF's kept-quantized row against its dequantized reference, and the needle test."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedserve.bench import corpus, quality, retrieval

RST = """\
.. _tut-intro:

*****************
An Informal Intro
*****************

In the following examples, input and output are distinguished by the presence or
absence of prompts: to repeat the example, you must type everything after the prompt.
Use the :keyword:`for` statement with :func:`range <range>` as in ``range(10)`` [#]_::

   >>> for i in range(3):
   ...     print(i)

.. note::

   This note is a directive body and is dropped.

Short line.

Comments in Python start with the hash character and extend to the end of the physical line.
"""


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    """A directory holding the sample reST file, repeated to give the windows enough text."""
    d = tmp_path_factory.mktemp("corpus")
    (d / "intro.rst.txt").write_text(RST * 6)
    return d


@pytest.fixture(scope="module")
def tiny_q41(tiny_ggufs):
    """The tiny model as a Q4_1 GGUF with its tokenizer (the session's file), prepared into a model directory."""
    from pagedserve.models.loader import resolve_model_dir

    return str(resolve_model_dir(str(tiny_ggufs("Q4_1", tokenizer=True))))


def test_prose_paragraphs_keep_sentences_and_drop_markup():
    paras = corpus.prose_paragraphs(RST)
    assert paras[0].startswith("In the following examples, input and output are distinguished")
    assert "Use the for statement with range as in range(10):" in paras[0] + paras[1]
    assert all(">>>" not in p and "directive" not in p and "Short line" not in p for p in paras)
    assert paras[-1].startswith("Comments in Python")


def test_missing_corpus_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        corpus.find_corpus_dir(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no .rst.txt"):
        corpus.load_prose(str(tmp_path))


def test_quality_on_a_gguf_keeps_its_quantized_tensors_beside_the_dequantized_reference(tiny_q41, tiny_corpus,
                                                                                        tmp_path, capsys):
    args = argparse.Namespace(model=tiny_q41, weights=["none", "gguf"], kv=["auto", "int8"], dtype=None,
                              corpus=str(tiny_corpus), windows=2, window_len=32, chunk=0,
                              gguf_activations="int16", prompts=2, prompt_len=8,
                              gen_tokens=4, kv_budget="1MiB", threads=None, max_model_len=128, decode_tokens=4,
                              repeats=1, json_out=str(tmp_path / "q.json"))
    assert quality.run_quality(args) == 0
    text = capsys.readouterr().out
    assert "full precision = float32, dequantized from the GGUF" in text and "| Q4_1 (GGUF) | float32 |" in text
    rows = {(r["weights"], r["kv"]): r for r in json.loads((tmp_path / "q.json").read_text())["rows"]}
    ref, kept = rows["none", "auto"], rows["Q4_1 (GGUF)", "auto"]
    assert ref["model_dtype"] == kept["model_dtype"] == "float32"
    # The same weights, kept as 4-bit nibbles + scales instead of dequantized float32.
    assert kept["weight_bytes"] < ref["weight_bytes"] / 3
    assert kept["mean_kl"] < 1e-3 and kept["top1_agreement"] > 0.95
    assert rows["Q4_1 (GGUF)", "int8"]["kv_bytes_per_token"] < ref["kv_bytes_per_token"]


def test_needles_are_hidden_at_their_depths_and_recall_is_counted_per_kv(tiny_model_dir, tiny_corpus, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    paragraphs, _ = corpus.load_prose(str(tiny_corpus))
    contexts = retrieval.make_contexts(tok, paragraphs, [160], needles=3, per_context=2, depths=[0.2, 0.8], seed=1)
    assert [len(c.needles) for c in contexts] == [2, 1]
    first = contexts[0]
    text = tok.decode(first.prompts[0])
    a, b = first.needles
    pos_a = text.index(retrieval.NEEDLE.format(name=a.name, code=a.code))
    pos_b = text.index(retrieval.NEEDLE.format(name=b.name, code=b.code))
    assert pos_a < pos_b  # depth 20% before depth 80%
    assert text.rstrip().endswith("assistant") or "What is the secret code for" in text
    assert all(abs(len(p) - 160) <= 24 for c in contexts for p in c.prompts)
    assert retrieval.recalled("It is 4821.", "4821") and not retrieval.recalled("14821", "4821")

    journal = retrieval.Journal(tmp_path / "needles.jsonl", {"test": 1})
    records = retrieval.measure_retrieval(str(tiny_model_dir), ["auto", "int4"], contexts, "float32", "none",
                                          max_model_len=256, journal=journal)  # raises if a KV block is left in use
    rows = retrieval.summarize(records)
    assert [(r.kv, r.needles) for r in rows] == [("float32", 3), ("int4", 3)]
    assert all(r.low <= r.recall <= r.high and r.seconds > 0 for r in rows)
    assert len(records) == 6 and all(isinstance(x["answer"], str) for x in records)
    table = retrieval.format_table(rows)
    assert "| int4 |" in table and "160 tokens" in table
    paired = retrieval.paired_comparisons(records, "float32")
    assert list(paired) == [("int4", 160)] and paired["int4", 160].items == 3
    assert "| int4 |" in retrieval.paired_table(paired, "float32")

    # Resuming: the journal's answers are kept, not recomputed (a planted answer survives), and
    # what it lacks is answered; a deadline already past answers nothing more.
    planted = [dict(r, answer="planted") for r in records if r["kv"] == "float32"]
    resumed = retrieval.Journal(tmp_path / "resumed.jsonl", {"test": 1})
    for unit in sorted({r["unit"] for r in planted}):
        resumed.add("auto", unit, [r for r in planted if r["unit"] == unit])
    assert retrieval.measure_retrieval(str(tiny_model_dir), ["auto", "int4"], contexts, "float32", "none",
                                       max_model_len=256, journal=resumed, deadline=0.0) == resumed.records
    assert len(resumed.records) == 3
    again = retrieval.measure_retrieval(str(tiny_model_dir), ["auto", "int4"], contexts, "float32", "none",
                                        max_model_len=256, journal=retrieval.Journal(tmp_path / "resumed.jsonl",
                                                                                     {"test": 1}))
    assert [r["answer"] for r in again if r["kv"] == "float32"] == ["planted"] * 3
    assert [r["answer"] for r in again if r["kv"] == "int4"] == [r["answer"] for r in records if r["kv"] == "int4"]
