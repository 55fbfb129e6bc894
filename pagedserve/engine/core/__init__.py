"""The engine core: token ids in, token ids out, one step at a time (what the core process runs).

``engine_core`` (:class:`~pagedserve.engine.core.engine_core.EngineCore`: the requests and the
step), ``builder`` (its construction: model, KV pool, block manager, scheduler, runner),
``assembly`` (after the model: sampling, stop conditions, output deltas), ``loop`` (the one busy
loop over a transport) and ``proc`` (the core process's entry point); the parts they drive:
``scheduler``, ``runner``, ``sampler``, ``spec_decode`` / ``ngram``, ``structured``, ``kv_events``,
``memory`` / ``profile_run``, ``cuda_graphs``, ``block_map_feed``, ``sequence``.

Nothing here imports the front end (:mod:`pagedserve.engine.frontend`) or the server
(tests/test_layering.py); what crosses to the front end is in :mod:`pagedserve.engine.wire`.
"""
