"""The gateway: API keys → tiers, token buckets (in-process or Redis), pools, priority and shedding."""

from pagedserve.gateway.config import ConfigError, GatewayConfig, TierConfig, load_config
from pagedserve.gateway.limiter import Bucket, Grant, Limiter, LimiterUnavailable, Reservation

__all__ = ["Bucket", "ConfigError", "GatewayConfig", "Grant", "Limiter", "LimiterUnavailable", "Reservation",
           "TierConfig", "load_config"]
