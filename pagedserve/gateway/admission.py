"""Admission by the buckets: reserve a request's tokens (and a request slot) or say why not.

The order of checks, and what each refusal means to the client:

* cost larger than the bucket can ever hold → 400 ``tokens_exceed_bucket``, not retryable;
* request bucket empty → 429 ``rate_limit_exceeded``, retry when one request has refilled;
* token bucket short   → 429 ``rate_limit_exceeded``, retry when the cost has refilled;
* limiter unreachable  → the tier's policy: ``open`` admits unmetered, ``closed`` → 503.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from pagedserve.gateway.config import KeyEntry, TierConfig
from pagedserve.gateway.limiter import Bucket, Limiter, LimiterUnavailable, Reservation

log = logging.getLogger("pagedserve.gateway.admission")


@dataclass
class BucketView:
    """What the ``x-ratelimit-*`` headers say about one bucket after the decision."""

    limit: float
    remaining: float
    reset_s: float  # seconds until the bucket is full again


@dataclass
class Decision:
    """The outcome of :meth:`Admission.admit`.

    ``reason`` is one of ``admitted``, ``admitted_limiter_down`` (fail-open), ``rate_limited_tokens``,
    ``rate_limited_requests``, ``too_large``, ``limiter_unavailable`` (fail-closed).
    """

    admitted: bool
    reason: str
    cost: float
    tokens: Reservation | None = None
    requests: Reservation | None = None
    token_view: BucketView | None = None
    request_view: BucketView | None = None
    retry_after_s: float = 0.0
    message: str = ""


def token_bucket(tier: TierConfig, key: KeyEntry) -> Bucket:
    """The token bucket a key draws from: its own, or its tier's shared one."""
    owner = key.digest.hex()[:24] if tier.bucket == "key" else "*"
    return Bucket(f"tok:{tier.name}:{owner}", float(tier.token_rate), float(tier.token_burst))


def request_bucket(tier: TierConfig, key: KeyEntry) -> Bucket | None:
    """The request-count bucket, when the tier has a request rate."""
    if tier.request_rate is None or tier.request_burst is None:
        return None
    owner = key.digest.hex()[:24] if tier.bucket == "key" else "*"
    return Bucket(f"req:{tier.name}:{owner}", float(tier.request_rate), float(tier.request_burst))


def _view(bucket: Bucket, level: float) -> BucketView:
    reset = 0.0 if level >= bucket.burst else (bucket.burst - level) / bucket.rate
    return BucketView(bucket.burst, max(0.0, level), reset)


async def bucket_views(limiter: Limiter, tier: TierConfig, key: KeyEntry) -> Decision:
    """A refusal-shaped :class:`Decision` carrying the buckets' current state, for the headers of a
    response that did not touch them (an overload shed); empty views if the limiter cannot answer."""
    decision = Decision(False, "peek", 0.0)
    try:
        tok = token_bucket(tier, key)
        decision.token_view = _view(tok, await limiter.peek(tok))
        req = request_bucket(tier, key)
        if req is not None:
            decision.request_view = _view(req, await limiter.peek(req))
    except LimiterUnavailable:
        pass
    return decision


class Admission:
    """Applies one tier's buckets and limiter-failure policy through a :class:`Limiter`."""

    def __init__(self, limiter: Limiter, breaker_reset_s: float = 1.0):
        self.limiter = limiter
        self.breaker_reset_s = breaker_reset_s

    async def admit(self, tier: TierConfig, key: KeyEntry, cost: float) -> Decision:
        """Reserve ``cost`` tokens (and one request) for ``key`` of ``tier``, or refuse with a reason."""
        tok = token_bucket(tier, key)
        req = request_bucket(tier, key)
        if cost > tok.burst:
            return Decision(False, "too_large", cost, message=(
                f"This request needs {int(cost)} tokens (its prompts + max_tokens per sequence) but tier '{tier.name}' allows at "
                f"most {int(tok.burst)} tokens at once; it can never pass. Lower max_tokens or shorten the prompt."))
        req_res: Reservation | None = None
        try:
            req_view = None
            if req is not None:
                g = await self.limiter.acquire(req, 1)
                req_view = _view(req, g.remaining)
                if not g.allowed:
                    return Decision(False, "rate_limited_requests", cost, request_view=req_view,
                                    retry_after_s=g.retry_after_s, message=(
                                        f"Rate limit reached for tier '{tier.name}' on requests: limit "
                                        f"{int(req.burst)} (refill {req.rate:g}/s), used {int(req.burst - g.remaining)}, "
                                        f"requested 1. Please try again in {format_duration(g.retry_after_s)}."))
                req_res = Reservation(self.limiter, req, 1)
            g = await self.limiter.acquire(tok, cost)
            tok_view = _view(tok, g.remaining)
            if not g.allowed:
                if req_res is not None:  # the request slot was not used after all
                    await req_res.settle(0)
                    req_view = _view(req, (req_view.remaining if req_view else 0) + 1)
                return Decision(False, "rate_limited_tokens", cost, token_view=tok_view, request_view=req_view,
                                retry_after_s=g.retry_after_s, message=(
                                    f"Rate limit reached for tier '{tier.name}' on tokens: limit {int(tok.burst)} "
                                    f"(refill {tok.rate:g}/s), used {math.ceil(tok.burst - g.remaining)}, requested "
                                    f"{int(cost)}. Please try again in {format_duration(g.retry_after_s)}."))
            return Decision(True, "admitted", cost, tokens=Reservation(self.limiter, tok, cost), requests=req_res,
                            token_view=tok_view, request_view=req_view)
        except LimiterUnavailable as e:
            if tier.on_limiter_error == "open":
                log.warning("limiter unavailable, tier %s fails open: %s", tier.name, e)
                return Decision(True, "admitted_limiter_down", cost, message=str(e))
            log.warning("limiter unavailable, tier %s fails closed: %s", tier.name, e)
            return Decision(False, "limiter_unavailable", cost, retry_after_s=self.breaker_reset_s, message=(
                "The rate limiter is unavailable and this tier fails closed; please retry shortly."))


def format_duration(seconds: float) -> str:
    """Seconds as OpenAI writes them in messages and reset headers: ``20ms``, ``1.5s``, ``6m0s``."""
    if math.isinf(seconds):
        return "never"
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    m, s = divmod(int(math.ceil(seconds)), 60)
    return f"{m}m{s}s"


