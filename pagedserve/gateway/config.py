"""The gateway's TOML config: keys → tiers → pools, validated once at start with line numbers.

Example (see ``examples/gateway.toml`` for every field)::

    [pools.shared]
    replicas = ["http://127.0.0.1:8001"]

    [tiers.paid]
    token_rate = 2000        # LLM tokens per second
    token_burst = 20000      # bucket size
    pools = ["shared"]
    priority = 0             # lower is served sooner in a shared pool
    max_queue_wait_s = 1.0

    [keys]
    "sk-paid-1" = "paid"
    "sk-free-1" = { tier = "free", name = "alice" }
"""

from __future__ import annotations

import hashlib
import math
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

SALT_MODES = ("key", "tier", "shared")
BUCKET_SCOPES = ("key", "tier")
LIMITER_POLICIES = ("open", "closed")
TOKEN_COUNTS = ("tokenize", "bytes")
LOAD_SOURCES = ("auto", "pagedserve", "vllm", "none")


@dataclass(frozen=True)
class Bound:
    """The range a numeric setting must lie in: finite, from ``low`` (excluded when ``above``) to ``high``.

    Every number in the file has one. A value that TOML accepts but the gateway cannot use (``inf``,
    ``nan``, a negative rate, a bucket of 1e300 tokens) would otherwise pass the start and turn each
    request of its tier into a 500, or poison the Redis script (its key expiry overflows)."""

    low: float
    high: float
    integer: bool = False
    above: bool = False
    unit: str = ""

    def holds(self, v: object) -> bool:
        """Whether ``v`` is a number (an integer if required) within the bounds."""
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (self.integer and not isinstance(v, int)):
            return False
        if isinstance(v, float) and not math.isfinite(v):
            return False
        return (v > self.low if self.above else v >= self.low) and v <= self.high

    def message(self, name: str, v: object) -> str:
        """One line naming the setting, its bounds, what they count and the value found."""
        kind = "an integer" if self.integer else "a number"
        unit = f" ({self.unit})" if self.unit else ""
        return f"{name} must be {kind} {'>' if self.above else '>='} {_fmt(self.low)} and <= {_fmt(self.high)}" \
               f"{unit}, got {v!r}"


def _fmt(x: float) -> str:
    """``1e9`` rather than ``1000000000.0``; exact integers as they are."""
    if isinstance(x, int):
        return str(x)
    return f"{x:g}".replace("e+0", "e").replace("e+", "e")


# The bounds of every numeric setting. Upper bounds are far beyond any real deployment, so they
# only stop typos and hostile files; where a value feeds arithmetic (a bucket's refill time, a
# Redis key's expiry, a header) they keep it finite and exact.
GATEWAY_BOUNDS = {
    "port": Bound(0, 65535, integer=True, unit="a TCP port"),
    "redis_timeout_s": Bound(0, 60, above=True, unit="seconds per Redis call"),
    "redis_breaker_reset_s": Bound(0, 3600, above=True, unit="seconds"),
    "load_poll_interval_s": Bound(0.01, 3600, unit="seconds; shorter would busy-poll the replicas"),
    "poll_timeouts_before_down": Bound(1, 1000, integer=True, unit="unanswered polls in a row"),
    "request_timeout_s": Bound(0, 86400, above=True, unit="seconds"),
    "connect_timeout_s": Bound(0, 600, above=True, unit="seconds"),
    "affinity_slack_s": Bound(0, 3600, unit="seconds"),
    "default_service_s": Bound(0, 3600, above=True, unit="seconds"),
    "response_ttl_s": Bound(0, 30 * 86400, above=True, unit="seconds a stored response lives"),
}
TIER_BOUNDS = {
    "token_rate": Bound(0, 1e9, above=True, unit="LLM tokens per second"),
    "token_burst": Bound(1, 1e12, unit="bucket size in tokens"),
    "request_rate": Bound(0, 1e6, above=True, unit="requests per second"),
    "request_burst": Bound(1, 1e9, unit="bucket size in requests"),
    # What the engine server accepts (a signed 32-bit integer, as vLLM): beyond it every request would be a 400.
    "priority": Bound(-(2**31), 2**31 - 1, integer=True, unit="lower is served sooner"),
    "max_queue_wait_s": Bound(0, 3600, above=True, unit="seconds"),
    "default_max_tokens": Bound(1, 10**9, integer=True, unit="tokens"),
    # pagedserve's request field takes 1-1024 (engine.sampling_params.MAX_STREAM_INTERVAL); the gateway
    # keeps its own copy because it imports nothing of the engine (its replicas may be vLLM too).
    "stream_interval": Bound(1, 1024, integer=True, unit="tokens per streamed event"),
}
POOL_BOUNDS = {
    # Below the 1e6 the seat arithmetic uses for "unknown" (seats._finite).
    "seats": Bound(1, 100_000, integer=True, unit="each replica's max_num_seqs"),
    "reserved_seats": Bound(0, 100_000, integer=True, unit="seats per replica kept for the best tier"),
}
# A bucket must refill within this (about 31 years): its Redis key expires when it would be full
# again, and a longer expiry overflows Redis's millisecond clock.
MAX_REFILL_S = 1e9


class ConfigError(ValueError):
    """A config file the gateway refuses, naming the file and line of the offending entry."""

    def __init__(self, message: str, *, path: str = "<config>", line: int | None = None):
        where = f"{path}:{line}" if line else path
        super().__init__(f"{where}: {message}")
        self.line = line


@dataclass
class TierConfig:
    """A tier: its bucket (LLM tokens per second and size), pools, priority and wait budget.

    ``pools`` are tried in order; the first whose estimated queue wait fits ``max_queue_wait_s``
    gets the request. ``bucket`` = ``key`` gives every API key its own bucket, ``tier`` one bucket
    shared by the tier. ``cache_salt`` = ``key`` | ``tier`` | ``shared`` scopes the engine's prefix
    cache. ``on_limiter_error`` = ``open`` admits (unlimited) while Redis is unreachable,
    ``closed`` refuses with 503.
    """

    name: str
    token_rate: float
    token_burst: float
    pools: list[str]
    request_rate: float | None = None
    request_burst: float | None = None
    priority: int = 0
    max_queue_wait_s: float = 5.0
    default_max_tokens: int = 256
    # Streamed requests of the tier get one event per this many tokens (the first at once): fewer
    # events to relay per token, in the replica, here and in the client, for a tier that can wait.
    stream_interval: int = 1
    bucket: str = "key"
    cache_salt: str = "key"
    on_limiter_error: str = "closed"


@dataclass
class PoolConfig:
    """A named list of engine replica base URLs (``http://host:port``, without ``/v1``).

    ``api_key`` is sent as ``Authorization: Bearer`` to replicas started with ``--api-key``.
    ``load_source`` says where a replica's load comes from: ``pagedserve`` (``GET /load``), ``vllm``
    (the ``vllm:num_requests_{running,waiting}`` gauges on ``GET /metrics``), ``none`` (``GET
    /health`` only) or ``auto`` (the first of those that answers). ``seats`` is each replica's
    number of seats (its ``--max-num-seqs``) where the load source does not say it (vLLM); with it
    the gateway forwards a request only while a replica has a seat for it and queues the rest
    itself. ``reserved_seats`` of each replica are kept for the pool's best-priority tier.

    ``best_priority`` is not a setting: :class:`GatewayConfig` derives it from the tiers (the best
    priority of those that use the pool, 0 if none), so that a pool's config is all
    :func:`~pagedserve.gateway.pools.build_pools` needs.
    """

    name: str
    replicas: list[str]
    api_key: str | None = None
    load_source: str = "auto"
    seats: int | None = None
    reserved_seats: int = 0
    best_priority: int = field(default=0, init=False)  # derived by GatewayConfig


@dataclass(frozen=True)
class KeyEntry:
    """One API key, held only as its SHA-256 digest; ``name`` is what logs show instead of it."""

    digest: bytes
    tier: str
    name: str


@dataclass
class GatewayConfig:
    """Everything the gateway needs: server settings, pools, tiers and keys."""

    pools: dict[str, PoolConfig]
    tiers: dict[str, TierConfig]
    keys: list[KeyEntry]
    host: str = "127.0.0.1"
    port: int = 8080
    redis_url: str | None = None
    redis_timeout_s: float = 0.25
    redis_breaker_reset_s: float = 1.0
    load_poll_interval_s: float = 0.25
    # A poll unanswered in time (max(0.5 s, 4 intervals)) may be load: the replica leaves routing after
    # this many in a row. A refused connection or an error status takes it out at once.
    poll_timeouts_before_down: int = 3
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 2.0
    token_count: str = "tokenize"
    affinity_slack_s: float = 0.25
    default_service_s: float = 1.0
    # The Responses API's store (pagedserve.apis.response_store): "memory" (this process) or a
    # redis:// URL, shared by every gateway given it; and how long a stored response lives.
    response_store: str = "memory"
    response_ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        for pool in self.pools.values():  # the tier its reserved seats are kept for
            pool.best_priority = min((t.priority for t in self.tiers.values() if pool.name in t.pools), default=0)

    def provisioned(self, pool: str) -> bool:
        """A pool is provisioned when exactly one tier may use it."""
        return sum(pool in t.pools for t in self.tiers.values()) == 1


def key_digest(key: str) -> bytes:
    """The SHA-256 digest keys are stored and compared as."""
    return hashlib.sha256(key.encode()).digest()


def _line_of(text: str, table: tuple[str, ...], key: str | None = None) -> int | None:
    """The 1-based line of ``[table]`` (or of ``key = ...`` inside it), found by a light scan."""
    header = re.compile(r"^\s*\[\s*([^\[\]]+?)\s*\]\s*(#.*)?$")
    current: tuple[str, ...] = ()
    header_line = None
    for i, raw in enumerate(text.splitlines(), 1):
        m = header.match(raw)
        if m:
            current = tuple(p.strip().strip('"\'') for p in re.split(r"\.(?=(?:[^\"]*\"[^\"]*\")*[^\"]*$)", m.group(1)))
            if current == table:
                header_line = i
                if key is None:
                    return i
            continue
        if current == table and key is not None:
            km = re.match(r"^\s*(\"[^\"]*\"|'[^']*'|[A-Za-z0-9_\-]+)\s*=", raw)
            if km and km.group(1).strip('"\'') == key:
                return i
    return header_line


def load_config(path: str | Path) -> GatewayConfig:
    """Read and validate a gateway TOML file; raises :class:`ConfigError` naming the line at fault."""
    path = str(path)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config: {e}", path=path) from e
    return parse_config(text, path=path)


# How the section parsers report a fault: ``fail(message, table, key)`` is the ConfigError to raise,
# naming the line of ``key`` in ``[table]`` (or of the table).
_Fail = Callable[..., ConfigError]


def parse_config(text: str, *, path: str = "<config>") -> GatewayConfig:
    """Validate TOML ``text`` (see :func:`load_config`)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"at line (\d+)", str(e))
        raise ConfigError(f"invalid TOML: {e}", path=path, line=int(m.group(1)) if m else None) from e

    def fail(msg: str, table: tuple[str, ...], key: str | None = None) -> ConfigError:
        return ConfigError(msg, path=path, line=_line_of(text, table, key))

    # Checked in this order, so that a file with several faults is always told the same first one.
    _check_sections(doc, fail)
    gw_raw = doc.get("gateway", {})
    gw_fields = {f.name for f in fields(GatewayConfig)} - {"pools", "tiers", "keys"}
    for k in gw_raw:
        if k not in gw_fields:
            raise fail(f"unknown setting gateway.{k}", ("gateway",), k)
    pools = _parse_pools(doc.get("pools", {}), fail)
    tiers = _parse_tiers(doc.get("tiers", {}), pools, fail)
    keys = _parse_keys(doc.get("keys", {}), tiers, fail)
    try:
        cfg = GatewayConfig(pools=pools, tiers=tiers, keys=keys, **gw_raw)
    except TypeError as e:
        raise fail(str(e), ("gateway",)) from e
    _check_gateway(cfg, fail)
    return cfg


def _check_sections(doc: dict[str, Any], fail: _Fail) -> None:
    """Only the known top-level sections, each a table."""
    known_top = {"gateway", "pools", "tiers", "keys"}
    for k in doc:
        if k not in known_top:
            raise fail(f"unknown section [{k}] (expected one of {sorted(known_top)})", (k,))
        if not isinstance(doc[k], dict):
            raise fail(f"{k} must be a table ([{k}] ...)", (), k)


def _parse_pools(section: dict[str, Any], fail: _Fail) -> dict[str, PoolConfig]:
    """``[pools.NAME]`` tables: at least one, and a replica URL in two pools with one shape."""
    pools = {name: _parse_pool(name, raw, fail) for name, raw in section.items()}
    if not pools:
        raise fail("no [pools.NAME] defined: the gateway needs at least one pool", ("pools",))
    seen_url: dict[str, PoolConfig] = {}
    for pool in pools.values():  # a URL in two pools is one replica: it cannot have two shapes
        for u in pool.replicas:
            other = seen_url.setdefault(u, pool)
            if (other.load_source, other.seats, other.api_key) != (pool.load_source, pool.seats, pool.api_key):
                raise fail(f"replica {u} is in pools {other.name} and {pool.name} with different "
                           "load_source, seats or api_key", ("pools", pool.name), "replicas")
    return pools


def _parse_pool(name: str, raw: Any, fail: _Fail) -> PoolConfig:
    """One ``[pools.NAME]`` table."""
    if not isinstance(raw, dict):
        raise fail(f"pools.{name} must be a table", ("pools",), name)
    replicas = raw.get("replicas")
    for k in raw:
        if k not in ("replicas", "api_key", "load_source", "seats", "reserved_seats"):
            raise fail(f"unknown setting pools.{name}.{k}", ("pools", name), k)
    if not isinstance(raw.get("api_key", ""), str):
        raise fail(f"pools.{name}.api_key must be a string", ("pools", name), "api_key")
    if (not isinstance(replicas, list) or not replicas
            or not all(isinstance(u, str) and re.match(r"^https?://", u) for u in replicas)):
        raise fail(f"pools.{name}.replicas must be a non-empty list of http(s):// URLs",
                   ("pools", name), "replicas")
    if raw.get("load_source", "auto") not in LOAD_SOURCES:
        raise fail(f"pools.{name}.load_source must be one of {LOAD_SOURCES}, got {raw['load_source']!r}",
                   ("pools", name), "load_source")
    seats = raw.get("seats")
    reserved = raw.get("reserved_seats", 0)
    for k, v in (("seats", seats), ("reserved_seats", reserved)):
        if v is not None and not POOL_BOUNDS[k].holds(v):
            raise fail(POOL_BOUNDS[k].message(f"pools.{name}.{k}", v), ("pools", name), k)
    if seats is not None and reserved >= seats:
        raise fail(f"pools.{name}.reserved_seats must be an integer >= 0 and below seats ({seats}), "
                   f"got {reserved}", ("pools", name), "reserved_seats")
    return PoolConfig(name, [u.rstrip("/") for u in replicas], raw.get("api_key") or None,
                      raw.get("load_source", "auto"), seats, reserved)


def _parse_tiers(section: dict[str, Any], pools: dict[str, PoolConfig], fail: _Fail) -> dict[str, TierConfig]:
    """``[tiers.NAME]`` tables, at least one, each naming known pools."""
    tier_fields = {f.name: f for f in fields(TierConfig)}
    tiers: dict[str, TierConfig] = {}
    for name, raw in section.items():
        table = ("tiers", name)
        if not isinstance(raw, dict):
            raise fail(f"tiers.{name} must be a table", ("tiers",), name)
        for k in raw:
            if k not in tier_fields or k == "name":
                raise fail(f"unknown setting tiers.{name}.{k}", table, k)
        for k in ("token_rate", "token_burst", "pools"):
            if k not in raw:
                raise fail(f"tiers.{name} is missing {k}", table)
        try:
            tier = TierConfig(name=name, **raw)
        except TypeError as e:
            raise fail(f"tiers.{name}: {e}", table) from e
        _check_tier(tier, pools, lambda msg, key: fail(msg, table, key))
        tiers[name] = tier
    if not tiers:
        raise fail("no [tiers.NAME] defined", ("tiers",))
    return tiers


def _parse_keys(section: dict[str, Any], tiers: dict[str, TierConfig], fail: _Fail) -> list[KeyEntry]:
    """``[keys]``: each key (or its ``sha256:`` digest) maps to a known tier, no key twice."""
    keys: list[KeyEntry] = []
    seen: set[bytes] = set()
    for i, (key, raw) in enumerate(section.items()):
        spec = {"tier": raw} if isinstance(raw, str) else raw
        if (not isinstance(spec, dict) or not isinstance(spec.get("tier"), str) or set(spec) - {"tier", "name"}
                or not isinstance(spec.get("name", ""), str)):
            raise fail("a key maps to a tier name or to { tier = \"...\", name = \"...\" } (both strings)",
                       ("keys",), key)
        if spec["tier"] not in tiers:
            raise fail(f"key entry #{i + 1} names unknown tier {spec['tier']!r}", ("keys",), key)
        if key.startswith("sha256:"):  # a digest in the file keeps the secret itself out of it
            try:
                digest = bytes.fromhex(key[len("sha256:"):])
            except ValueError:
                digest = b""
            if len(digest) != 32:
                raise fail(f"key entry #{i + 1}: sha256: must be followed by 64 hex digits", ("keys",), key)
        else:
            digest = key_digest(key)
        if digest in seen:
            raise fail(f"key entry #{i + 1} repeats an earlier key", ("keys",), key)
        seen.add(digest)
        keys.append(KeyEntry(digest, spec["tier"], str(spec.get("name", f"{spec['tier']}#{i + 1}"))))
    if not keys:
        raise fail("no API keys under [keys]", ("keys",))
    return keys


def _check_gateway(cfg: GatewayConfig, fail: _Fail) -> None:
    """The ``[gateway]`` settings' bounds and kinds."""
    for k, bound in GATEWAY_BOUNDS.items():
        if not bound.holds(getattr(cfg, k)):
            raise fail(bound.message(f"gateway.{k}", getattr(cfg, k)), ("gateway",), k)
    for k in ("host", "redis_url"):
        v = getattr(cfg, k)
        if not (isinstance(v, str) and v) and not (k == "redis_url" and v is None):
            raise fail(f"gateway.{k} must be a non-empty string, got {v!r}", ("gateway",), k)
    if not (isinstance(cfg.response_store, str)
            and (cfg.response_store == "memory" or cfg.response_store.startswith(("redis://", "rediss://")))):
        raise fail(f"gateway.response_store must be 'memory' or a redis:// URL, got {cfg.response_store!r}",
                   ("gateway",), "response_store")
    if cfg.token_count not in TOKEN_COUNTS:
        raise fail(f"gateway.token_count must be one of {TOKEN_COUNTS}, got {cfg.token_count!r}",
                   ("gateway",), "token_count")


def _check_tier(t: TierConfig, pools: dict[str, PoolConfig], fail: Any) -> None:
    if (t.request_rate is None) != (t.request_burst is None):
        raise fail(f"tiers.{t.name}: give request_rate and request_burst together", "request_rate")
    for k, bound in TIER_BOUNDS.items():
        v = getattr(t, k)
        if not (v is None and k.startswith("request_")) and not bound.holds(v):
            raise fail(bound.message(f"tiers.{t.name}.{k}", v), k)
    for kind in ("token", "request"):
        rate, burst = getattr(t, f"{kind}_rate"), getattr(t, f"{kind}_burst")
        if rate is not None and burst / rate > MAX_REFILL_S:
            raise fail(f"tiers.{t.name}.{kind}_rate is too small for its {kind}_burst: the bucket would take "
                       f"{_fmt(burst / rate)}s to refill (at most {_fmt(MAX_REFILL_S)}s)", f"{kind}_rate")
    if not isinstance(t.pools, list) or not t.pools or not all(isinstance(p, str) for p in t.pools):
        raise fail(f"tiers.{t.name}.pools must be a non-empty list of pool names", "pools")
    for p in t.pools:
        if p not in pools:
            raise fail(f"tiers.{t.name}.pools names unknown pool {p!r} (known: {sorted(pools)})", "pools")
    if t.default_max_tokens > t.token_burst:
        raise fail(f"tiers.{t.name}.default_max_tokens exceeds token_burst: no request could ever pass",
                   "default_max_tokens")
    for k, allowed in (("bucket", BUCKET_SCOPES), ("cache_salt", SALT_MODES),
                       ("on_limiter_error", LIMITER_POLICIES)):
        if getattr(t, k) not in allowed:
            raise fail(f"tiers.{t.name}.{k} must be one of {allowed}, got {getattr(t, k)!r}", k)
