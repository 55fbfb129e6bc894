"""The engine's front ends: what a server holds to drive a core, and text in and out (its modules:
docs/ARCHITECTURE.md)."""
