"""Config validation: every refusal names the offending line; keys compare in constant time."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.gateway.config import ConfigError, key_digest, load_config, parse_config
from pagedserve.gateway.keys import KeyRing, bearer_key

GOOD = """\
[gateway]
port = 9000

[pools.shared]
replicas = ["http://127.0.0.1:8002"]

[tiers.paid]
token_rate = 100
token_burst = 1000
pools = ["shared"]
priority = 0
max_queue_wait_s = 1.0

[tiers.free]
token_rate = 10
token_burst = 500
pools = ["shared"]
priority = 5

[keys]
"sk-paid" = { tier = "paid", name = "acme" }
"sk-free" = "free"
"""


def test_example_config_loads() -> None:
    cfg = load_config(Path(__file__).parents[2] / "examples" / "gateway.toml")
    assert set(cfg.tiers) == {"paid", "free"}
    assert cfg.provisioned("paid-dedicated") and not cfg.provisioned("shared")


def test_good_config() -> None:
    cfg = parse_config(GOOD)
    assert cfg.port == 9000 and cfg.tiers["free"].priority == 5
    assert KeyRing(cfg.keys).lookup("sk-paid").name == "acme"  # type: ignore[union-attr]
    assert KeyRing(cfg.keys).lookup("sk-free").tier == "free"  # type: ignore[union-attr]
    assert KeyRing(cfg.keys).lookup("sk-nope") is None
    assert KeyRing(cfg.keys).lookup("") is None and KeyRing(cfg.keys).lookup(None) is None
    # The secret is only held as its digest.
    assert all(e.digest != b"sk-paid" and len(e.digest) == 32 for e in cfg.keys)


@pytest.mark.parametrize("change, line, words", [
    (("priority = 5", "priority = \"high\""), 18, "priority must be an integer"),
    (("pools = [\"shared\"]\npriority = 0", "pools = [\"nope\"]\npriority = 0"), 10, "unknown pool 'nope'"),
    (("token_rate = 10\n", "token_rate = -1\n"), 15, "token_rate must be a number > 0"),
    (("\"sk-free\" = \"free\"", "\"sk-free\" = \"gold\""), 22, "unknown tier 'gold'"),
    (("port = 9000", "prot = 9000"), 2, "unknown setting gateway.prot"),
    (("max_queue_wait_s = 1.0", "max_queue_wait_s = 1.0\nbucket = \"global\""), 13, "bucket must be one of"),
    (("replicas = [\"http://127.0.0.1:8002\"]", "replicas = [\"127.0.0.1:8002\"]"), 5, "http(s):// URLs"),
    (("[keys]", "[keys\n"), 20, "invalid TOML"),
])
def test_errors_name_the_line(change: tuple[str, str], line: int, words: str) -> None:
    text = GOOD.replace(*change)
    assert text != GOOD
    with pytest.raises(ConfigError) as err:
        parse_config(text, path="gw.toml")
    assert err.value.line == line, str(err.value)
    assert str(err.value).startswith(f"gw.toml:{line}: ")
    assert words in str(err.value)


def test_sha256_keys_and_duplicates() -> None:
    digest = key_digest("sk-secret").hex()
    cfg = parse_config(GOOD.replace('"sk-free" = "free"', f'"sha256:{digest}" = "free"'))
    assert KeyRing(cfg.keys).lookup("sk-secret").tier == "free"  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="repeats an earlier key"):
        parse_config(GOOD + f'"sha256:{key_digest("sk-paid").hex()}" = "free"\n')


def test_bearer_key() -> None:
    assert bearer_key("Bearer sk-1") == "sk-1"
    assert bearer_key("bearer  sk-1 ") == "sk-1"
    assert bearer_key("Basic abc") is None and bearer_key(None) is None and bearer_key("Bearer ") is None


def test_pool_seat_settings() -> None:
    cfg = parse_config(GOOD.replace('replicas = ["http://127.0.0.1:8002"]',
                                    'replicas = ["http://127.0.0.1:8002"]\nload_source = "vllm"\nseats = 8\n'
                                    'reserved_seats = 2'))
    pool = cfg.pools["shared"]
    assert (pool.load_source, pool.seats, pool.reserved_seats) == ("vllm", 8, 2)
    assert (parse_config(GOOD).pools["shared"].load_source, parse_config(GOOD).pools["shared"].seats) == ("auto", None)


@pytest.mark.parametrize("setting, line, words", [
    ('load_source = "triton"', 6, "load_source must be one of"),
    ("seats = 0", 6, "seats must be an integer >= 1"),
    ("reserved_seats = -1", 6, "reserved_seats must be an integer >= 0"),
    ("seats = 4\nreserved_seats = 4", 7, "reserved_seats must be an integer >= 0 and below seats"),
])
def test_pool_seat_settings_errors_name_the_line(setting: str, line: int, words: str) -> None:
    text = GOOD.replace('replicas = ["http://127.0.0.1:8002"]', f'replicas = ["http://127.0.0.1:8002"]\n{setting}')
    with pytest.raises(ConfigError) as err:
        parse_config(text, path="gw.toml")
    assert err.value.line == line and words in str(err.value)


def test_a_replica_in_two_pools_has_one_shape() -> None:
    two = GOOD.replace('[tiers.paid]', '[pools.other]\nreplicas = ["http://127.0.0.1:8002"]\nseats = 4\n\n[tiers.paid]')
    with pytest.raises(ConfigError, match="different load_source, seats or api_key"):
        parse_config(two)
    keyed = GOOD.replace('[tiers.paid]', '[pools.other]\nreplicas = ["http://127.0.0.1:8002"]\napi_key = "k"\n\n[tiers.paid]')
    with pytest.raises(ConfigError, match="different load_source, seats or api_key"):
        parse_config(keyed)


@pytest.mark.parametrize("change, line, words", [
    # Values TOML accepts and the gateway cannot use: each used to pass and break every request.
    (("token_rate = 10\n", "token_rate = inf\n"), 15, "tiers.free.token_rate must be a number > 0 and <= 1e9"),
    (("token_rate = 10\n", "token_rate = nan\n"), 15, "got nan"),
    (("token_rate = 10\n", "token_rate = -inf\n"), 15, "got -inf"),
    (("token_rate = 10\n", "token_rate = 1e10\n"), 15, "token_rate must be a number > 0 and <= 1e9"),
    (("token_rate = 10\n", "token_rate = true\n"), 15, "got True"),
    (("token_burst = 500", "token_burst = inf"), 16, "tiers.free.token_burst must be a number >= 1 and <= 1e12"),
    (("token_burst = 500", "token_burst = 1e300"), 16, "token_burst must be"),
    (("token_burst = 500", "token_burst = 0.5"), 16, "token_burst must be a number >= 1"),
    (("token_rate = 10\n", "token_rate = 1e-9\n"), 15, "token_rate is too small for its token_burst"),
    (("priority = 5", "priority = 5\nrequest_rate = inf\nrequest_burst = 5"), 19, "request_rate must be a number > 0"),
    (("priority = 5", "priority = 5\nrequest_rate = 1\nrequest_burst = nan"), 20, "request_burst must be a number >= 1"),
    (("priority = 5", "priority = 5\nrequest_rate = 1\nrequest_burst = 0.5"), 20, "request_burst must be a number >= 1"),
    (("priority = 5", "priority = 5\nrequest_rate = 1e-9\nrequest_burst = 10"), 19, "request_rate is too small"),
    (("priority = 5", "priority = 1e3"), 18, "tiers.free.priority must be an integer >= -2147483648"),
    (("priority = 5", "priority = 2147483648"), 18, "priority must be an integer"),
    (("max_queue_wait_s = 1.0", "max_queue_wait_s = inf"), 12, "tiers.paid.max_queue_wait_s must be a number > 0"),
    (("max_queue_wait_s = 1.0", "max_queue_wait_s = 0"), 12, "max_queue_wait_s must be a number > 0"),
    (("priority = 5", "priority = 5\ndefault_max_tokens = 2.5"), 19, "default_max_tokens must be an integer >= 1"),
    (("priority = 5", "priority = 5\nstream_interval = 0"), 19, "tiers.free.stream_interval must be an integer >= 1 and <= 1024"),
    (("priority = 5", "priority = 5\nstream_interval = 2.5"), 19, "stream_interval must be an integer"),
    (("port = 9000", "port = 70000"), 2, "gateway.port must be an integer >= 0 and <= 65535"),
    (("port = 9000", "port = true"), 2, "gateway.port must be an integer"),
    (("port = 9000", "port = 9000\nload_poll_interval_s = 0.0001"), 3, "load_poll_interval_s must be a number >= 0.01"),
    (("port = 9000", "port = 9000\nredis_timeout_s = inf"), 3, "gateway.redis_timeout_s must be a number > 0"),
    (("port = 9000", "port = 9000\nredis_breaker_reset_s = nan"), 3, "redis_breaker_reset_s must be"),
    (("port = 9000", "port = 9000\nrequest_timeout_s = -1"), 3, "request_timeout_s must be a number > 0"),
    (("port = 9000", "port = 9000\nconnect_timeout_s = 1e9"), 3, "connect_timeout_s must be a number > 0 and <= 600"),
    (("port = 9000", "port = 9000\naffinity_slack_s = -0.1"), 3, "affinity_slack_s must be a number >= 0"),
    (("port = 9000", "port = 9000\ndefault_service_s = inf"), 3, "default_service_s must be a number > 0"),
    (("port = 9000", "port = 9000\nhost = 5"), 3, "gateway.host must be a non-empty string"),
    (("port = 9000", "port = 9000\nredis_url = 1"), 3, "gateway.redis_url must be a non-empty string"),
    (("replicas = [\"http://127.0.0.1:8002\"]", "replicas = [\"http://127.0.0.1:8002\"]\nseats = inf"), 6,
     "pools.shared.seats must be an integer >= 1 and <= 100000"),
    (("replicas = [\"http://127.0.0.1:8002\"]", "replicas = [\"http://127.0.0.1:8002\"]\nseats = 10000000"), 6,
     "seats must be an integer"),
    (("pools = [\"shared\"]\npriority = 5", "pools = [{}]\npriority = 5"), 17, "pools must be a non-empty list of pool names"),
    (("\"sk-free\" = \"free\"", "\"sk-free\" = { tier = \"free\", name = 3 }"), 22, "both strings"),
])
def test_every_number_is_bounded(change: tuple[str, str], line: int, words: str) -> None:
    """Every numeric setting has bounds; a value outside is one line naming the setting, its line,
    its bounds and the value (never a traceback, never a gateway that answers 500)."""
    text = GOOD.replace(*change)
    assert text != GOOD
    with pytest.raises(ConfigError) as err:
        parse_config(text, path="gw.toml")
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"gw.toml:{line}: "), message
    assert words in message, message


@pytest.mark.parametrize("section", ["keys = 5", "tiers = \"x\"", "pools = []", "gateway = 1"])
def test_a_section_that_is_not_a_table(section: str) -> None:
    with pytest.raises(ConfigError, match=r"^gw.toml:1: \w+ must be a table"):
        parse_config(section + "\n", path="gw.toml")


def test_bounds_allow_what_deployments_use() -> None:
    """The bench's huge buckets (W6: 1e7 tokens/s) and the tests' near-zero refills still load."""
    cfg = parse_config(GOOD.replace("token_rate = 100\n", "token_rate = 10000000\n")
                       .replace("token_burst = 1000\n", "token_burst = 10000000\n")
                       .replace("token_rate = 10\n", "token_rate = 0.001\n"))
    assert cfg.tiers["paid"].token_rate == 1e7 and cfg.tiers["free"].token_rate == 0.001


def test_the_tier_stream_interval_bound_is_the_replica_fields():
    from pagedserve.engine.sampling_params import MAX_STREAM_INTERVAL
    from pagedserve.gateway.config import TIER_BOUNDS

    assert TIER_BOUNDS["stream_interval"].high == MAX_STREAM_INTERVAL
