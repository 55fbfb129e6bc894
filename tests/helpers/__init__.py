"""Helpers shared by the integration tests (real servers on 127.0.0.1)."""
