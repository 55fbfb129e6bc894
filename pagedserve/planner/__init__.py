"""The serving arithmetic: sizing, queueing, token buckets and a simulator (pure functions).

A small importable API; ``pagedserve plan …`` and ``pagedserve simulate`` are its command line,
and the engine sizes its KV pool with :func:`kv_bytes_per_token` from here.
"""

from pagedserve.planner.bucket import BucketAdmits, BucketError, bucket_admits, replay_token_bucket
from pagedserve.planner.queueing import (CapacityDrop, QueueingError, QueueResult, capacity_drop, erlang_c,
                                         max_arrival_rate_for_wait, mg1, mm1, mmc, priority_waits,
                                         shed_for_utilization, shed_for_wait, solve_mm1_from_waits)
from pagedserve.planner.shapes import ModelShape, ModelShapeError, load_model_shape, shape_from_config, standard_shape
from pagedserve.planner.simulator import PoolSpec, SimConfig, SimResult, SimulationError, TierSpec, simulate
from pagedserve.planner.sizing import (KV_ELEMENT_BYTES, ReservationPlan, SizingError, blocks_per_sequence,
                                       decode_bytes_per_step, decode_tokens_per_s, kv_bytes_per_request,
                                       kv_bytes_per_token, kv_element_bytes, kv_memory_left, num_kv_blocks,
                                       paged_seats, prefill_seconds, reservation_plan, reservation_utilization,
                                       seats_at_max_len, tail_waste_bytes, weight_bytes, worst_case_seats)

__all__ = [
    "KV_ELEMENT_BYTES", "BucketAdmits", "BucketError", "CapacityDrop", "ModelShape", "ModelShapeError", "PoolSpec",
    "QueueResult", "QueueingError", "ReservationPlan", "SimConfig", "SimResult", "SimulationError", "SizingError",
    "TierSpec", "blocks_per_sequence", "bucket_admits", "capacity_drop", "decode_bytes_per_step",
    "decode_tokens_per_s", "erlang_c", "kv_bytes_per_request", "kv_bytes_per_token", "kv_element_bytes",
    "kv_memory_left", "load_model_shape", "max_arrival_rate_for_wait", "mg1", "mm1", "mmc", "num_kv_blocks",
    "paged_seats", "prefill_seconds", "priority_waits", "replay_token_bucket", "reservation_plan",
    "reservation_utilization", "seats_at_max_len", "shape_from_config", "shed_for_utilization", "shed_for_wait",
    "simulate", "solve_mm1_from_waits", "standard_shape", "tail_waste_bytes", "weight_bytes", "worst_case_seats",
]
