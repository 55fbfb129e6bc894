"""The engine core: token ids in, token ids out, one step at a time (what the core process runs;
its modules: docs/ARCHITECTURE.md). Nothing here imports the front end
(:mod:`pagedserve.engine.frontend`) or the server (tests/test_layering.py); what crosses to the
front end is in :mod:`pagedserve.engine.wire`.
"""
