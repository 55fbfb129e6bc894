"""The package layering, read from the source: who may import what (docs/ARCHITECTURE.md).

Every import statement counts, at module level or inside a function, TYPE_CHECKING included: a
deferred import still ties the importer to what it names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pagedserve

ROOT = Path(pagedserve.__file__).parent

# What a server of the engine (the HTTP server, the Ray replica, the gateway) may import of it:
# the package itself (pagedserve/engine/__init__.py: the client interface, the factory that starts
# a core and connects a client, the request / output / parameter types), the shared types' modules
# and the engine's flags. Nothing that schedules, pages, runs or supervises a core.
ENGINE_DOOR = {
    "pagedserve.engine",
    "pagedserve.engine.outputs",
    "pagedserve.engine.sampling_params",
    "pagedserve.engine.wire",  # ModelFacts
    "pagedserve.engine.block_map",  # the dashboard's snapshot type
    "pagedserve.engine.args",  # the engine's flags and EngineConfig from them
}

# The planner is arithmetic: it may read model shapes and KV sizing formulas, never run a model.
PLANNER_ALLOWED_OUTSIDE = {"pagedserve.models.standard", "pagedserve.kv.sizing", "pagedserve.config",
                           "pagedserve.errors"}


def _imported(node: ast.ImportFrom) -> set[str]:
    """The modules ``from X import a, b`` ties the importer to: ``X.a`` where that is a module of
    the package (``from pagedserve.engine import factory``), else ``X`` itself."""
    names = set()
    for alias in node.names:
        sub = f"{node.module}.{alias.name}"
        path = ROOT.parent / sub.replace(".", "/")
        names.add(sub if path.with_suffix(".py").exists() or (path / "__init__.py").exists() else node.module)
    return names


def _imports(package: str) -> dict[str, set[str]]:
    """module path -> every ``pagedserve...`` / ``torch`` module it imports."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.update(_imported(node))
        out[str(path.relative_to(ROOT.parent))] = {n for n in names if n.startswith(("pagedserve", "torch"))}
    return out


def test_servers_reach_the_engine_only_through_the_client_door() -> None:
    crossings = {
        module: sorted(n for n in names if n.startswith("pagedserve.engine") and n not in ENGINE_DOOR)
        for package in ("server", "ray_serve", "gateway")
        for module, names in _imports(package).items()
    }
    assert {m: n for m, n in crossings.items() if n} == {}


def test_the_planner_imports_nothing_that_runs_a_model() -> None:
    crossings = {
        module: sorted(n for n in names if n not in PLANNER_ALLOWED_OUTSIDE and not n.startswith("pagedserve.planner"))
        for module, names in _imports("planner").items()
    }
    assert {m: n for m, n in crossings.items() if n} == {}


def test_the_engine_core_does_not_import_the_front_end_or_the_server() -> None:
    """The core side (engine/core/: what the core process runs) knows nothing of clients, text or HTTP."""
    front_or_server = ("pagedserve.engine.frontend", "pagedserve.server", "pagedserve.gateway", "pagedserve.ray_serve",
                       "pagedserve.tokenizer", "pagedserve.engine.args")
    crossings = {m: sorted(n for n in names if n.startswith(front_or_server) or n == "pagedserve.engine")
                 for m, names in _imports("engine/core").items()}
    assert {m: n for m, n in crossings.items() if n} == {}


def test_the_shared_engine_types_import_neither_side() -> None:
    """wire, outputs, sampling_params, block_map and process_placement sit between the core and the front end: they
    import neither (a deferred import of the core's grammar check aside: sampling_params asks the
    core's grammar compiler whether a spec compiles, on the front end's thread)."""
    shared = {f"pagedserve/engine/{m}.py" for m in ("wire", "outputs", "sampling_params", "block_map", "process_placement")}
    allowed = {"pagedserve.engine.core.structured"}
    crossings = {m: sorted(n for n in names if n.startswith(("pagedserve.engine.core", "pagedserve.engine.frontend"))
                           and n not in allowed)
                 for m, names in _imports("engine").items() if m in shared}
    assert {m: n for m, n in crossings.items() if n} == {}


def test_the_front_end_reaches_the_core_only_to_build_it_in_process() -> None:
    """A front end runs the core only where it holds one in its own process (the in-process
    client's thread, the synchronous Engine, the launcher that spawns the core process): every
    other front-end module talks to the core through the wire."""
    may_build = {"pagedserve/engine/frontend/factory.py", "pagedserve/engine/frontend/async_engine.py",
                 "pagedserve/engine/frontend/engine.py", "pagedserve/engine/frontend/core_launch.py"}
    crossings = {m: sorted(n for n in names if n.startswith("pagedserve.engine.core"))
                 for m, names in _imports("engine/frontend").items() if m not in may_build}
    assert {m: n for m, n in crossings.items() if n} == {}


# Environment variables the package may read: a location and a secret's default, never a switch of
# behaviour (those are EngineConfig fields with flags; docs/SERVER.md#flags).
ALLOWED_ENVIRONMENT = {"PAGEDSERVE_CACHE", "PAGEDSERVE_API_KEY"}


def _environment_reads(tree: ast.AST) -> set[str]:
    """The ``PAGEDSERVE_*`` names read through ``os.environ.get``, ``os.getenv`` or ``os.environ[...]``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args:
            f = ast.unparse(node.func)
            if f in ("os.environ.get", "os.getenv", "environ.get", "getenv"):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("os.environ", "environ"):
            key = node.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str) and key.value.startswith("PAGEDSERVE_"):
            names.add(key.value)
    return names


def test_no_behaviour_switch_is_read_from_the_environment() -> None:
    reads = {str(path.relative_to(ROOT.parent)): _environment_reads(ast.parse(path.read_text(), str(path)))
             for path in sorted(ROOT.rglob("*.py"))}
    assert set().union(*reads.values()) <= ALLOWED_ENVIRONMENT, \
        {m: sorted(n - ALLOWED_ENVIRONMENT) for m, n in reads.items() if n - ALLOWED_ENVIRONMENT}
    assert set().union(*reads.values()) == ALLOWED_ENVIRONMENT  # the check does find reads
