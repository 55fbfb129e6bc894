"""Swap a model's ``nn.Linear`` layers for another implementation, in place (quantized, prepacked).

A tied LM head (``lm_head`` is None: the logits reuse the embedding matrix) can get a layer of
its own too, built on the embedding weight (``tied_head=True``): the logits matmul reads that
whole matrix every decode step, so a smaller quantized head gains as much as any linear, while
lookups keep using the table. A swap that would only re-lay out the same bytes (prepacking)
passes ``tied_head=False``: it would hold the matrix twice.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module],
                    accept: Callable[[nn.Linear], bool] = lambda linear: True, tied_head: bool = True) -> int:
    """Replace every plain ``nn.Linear`` that ``accept`` takes by ``make(linear)`` (and, with
    ``tied_head``, a tied LM head too); returns how many."""
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear and accept(m)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, make(linear))  # "": the model itself
    embed = getattr(model, "embed_tokens", None)
    if tied_head and "lm_head" in vars(model) and model.lm_head is None and isinstance(embed, nn.Embedding):
        head = nn.Linear(embed.embedding_dim, embed.num_embeddings, bias=False, device="meta")
        head.weight = embed.weight  # shared, not copied
        if accept(head):
            model.lm_head = make(head)
            return len(targets) + 1
    return len(targets)
