"""pagedserve: LLM serving with a paged KV cache, continuous batching and a tiered gateway."""

from pagedserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and transformers: import it only when asked for.
    if name == "LLM":
        from pagedserve.engine.frontend.llm import LLM

        return LLM
    raise AttributeError(name)
