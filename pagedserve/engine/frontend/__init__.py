"""The engine's front ends: what a server holds to drive a core, and text in and out.

``client`` (the :class:`~pagedserve.engine.frontend.client.EngineClient` interface), ``factory``
(start a core, get a client), ``core_client`` (the one client: commands out, outputs in, over a
transport), ``async_engine`` (the core on a thread of this process), ``mp_client`` (the core in
its own process), ``core_launch`` / ``core_restart`` (spawning and supervising that process),
``output_processor`` and ``detokenizer`` (token ids to text, stop strings), ``request_check``
(the front end's one check of a request), ``engine`` / ``llm`` (the synchronous engine and the
offline ``LLM``), ``generate_cli`` (``pagedserve generate``).
"""
