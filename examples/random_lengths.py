"""W4b's requests as token ids, shared by the offline scripts of pagedserve and of vLLM (it imports
neither, so each engine's own virtualenv can load it): 64 prompts of random ids with lengths
U[216, 360] and output lengths U[108, 180], what vLLM's `random` dataset at 288 / 144 with range
ratio 0.75 asks for. The same seed gives the same batch on both sides."""

import random


def w4b_batch(seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output tokens) for each of the 64 requests."""
    rng = random.Random(seed)
    batch = []
    for _ in range(64):
        prompt = [rng.randrange(100, 31_000) for _ in range(rng.randint(216, 360))]
        batch.append((prompt, rng.randint(108, 180)))
    return batch
