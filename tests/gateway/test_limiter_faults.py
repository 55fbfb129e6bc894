"""Redis dies or freezes mid-run: no crash, no hang past the timeout, the tier policy holds, and
service comes back by itself when Redis does."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from pagedserve.gateway.admission import Admission
from pagedserve.gateway.breaker import CircuitBreaker
from pagedserve.gateway.config import KeyEntry, TierConfig, key_digest
from pagedserve.gateway.limiter_redis import RedisLimiter

TIMEOUT_S = 0.1
RESET_S = 0.3


def _tier(name: str, policy: str) -> TierConfig:
    return TierConfig(name=name, token_rate=1e6, token_burst=1e6, pools=["p"], on_limiter_error=policy)


async def _run(redis_server: Any, fault: str) -> list[tuple[float, float, str, str]]:
    """Admit two tiers every 20 ms for 2.6 s; the fault starts at 0.4 s and ends at 1.2 s."""
    limiter = RedisLimiter(redis_server.url, timeout_s=TIMEOUT_S, breaker=CircuitBreaker(3, RESET_S))
    admission = Admission(limiter, breaker_reset_s=RESET_S)
    tiers = {"open": _tier("open-tier", "open"), "closed": _tier("closed-tier", "closed")}
    key = KeyEntry(key_digest("sk-fault"), "x", "fault-key")
    log: list[tuple[float, float, str, str]] = []
    t0 = time.monotonic()
    phase = "before"
    while (now := time.monotonic() - t0) < 2.6:
        if phase == "before" and now >= 0.4:
            redis_server.kill() if fault == "kill" else redis_server.freeze()
            phase = "fault"
        elif phase == "fault" and now >= 1.2:
            redis_server.start() if fault == "kill" else redis_server.thaw()
            phase = "after"
        for policy, tier in tiers.items():
            s = time.monotonic()
            d = await admission.admit(tier, key, 10)
            log.append((s - t0, time.monotonic() - s, policy, d.reason))
            if d.tokens is not None:
                try:
                    await d.tokens.settle(5)
                except Exception:
                    pass  # a refund lost to the outage is logged by the limiter, never retried
        await asyncio.sleep(0.02)
    assert limiter.healthy
    await limiter.close()
    return log


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_redis_fault_policy_and_recovery(own_redis: Any, fault: str) -> None:
    log = asyncio.run(_run(own_redis, fault))
    # No request waits on a dead or frozen Redis for longer than the configured timeout (+ slack).
    assert max(d for _, d, _, _ in log) < 2 * TIMEOUT_S + 0.3
    before = [(p, r) for t, _, p, r in log if t < 0.38]
    during = [(p, r) for t, _, p, r in log if 0.45 < t < 1.15]
    after = [(p, r) for t, _, p, r in log if t > 1.2 + RESET_S + 0.4]
    assert before and during and after
    assert all(r == "admitted" for _, r in before)
    # The policy holds while Redis is gone: fail-open admits unmetered, fail-closed refuses.
    assert all(r == "admitted_limiter_down" for p, r in during if p == "open")
    assert all(r == "limiter_unavailable" for p, r in during if p == "closed")
    # And the limiter is back without restarting anything.
    assert all(r == "admitted" for _, r in after)
