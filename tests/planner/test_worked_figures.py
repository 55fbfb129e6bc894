"""Every worked figure of the source material, reproduced exactly, one named test each."""

from __future__ import annotations

import math

import pytest

from pagedserve.planner import queueing, sizing
from pagedserve.planner.units import format_bytes

KIB, MIB, GIB = 1024, 1024**2, 1024**3

# The worked model: 40 layers, 8 KV heads of 128 dims, 16-bit KV.
WORKED_BPT = sizing.kv_bytes_per_token(40, 8, 128, sizing.kv_element_bytes("bf16"))


def test_kv_bytes_per_token_40_layers_8_kv_heads_128_dims_bf16_is_163840_bytes() -> None:
    assert WORKED_BPT == 163_840
    assert WORKED_BPT == 160 * KIB
    assert format_bytes(WORKED_BPT) == "160 KiB"


def test_kv_per_request_at_4096_tokens_is_640_mib() -> None:
    assert sizing.kv_bytes_per_request(WORKED_BPT, 4096) == 640 * MIB
    assert format_bytes(sizing.kv_bytes_per_request(WORKED_BPT, 4096)) == "640 MiB"


def test_ten_users_at_4096_tokens_reserve_6_25_gib() -> None:
    plan = sizing.reservation_plan(WORKED_BPT, 4096, 1200, users=10)
    assert plan.reserved_total == 6.25 * GIB
    assert format_bytes(plan.reserved_total) == "6.25 GiB"


def test_9_gib_free_holds_14_seats_and_refuses_the_fifteenth() -> None:
    seats = sizing.worst_case_seats(9 * GIB, WORKED_BPT, 4096)
    assert seats == 14
    assert 14 * 640 * MIB <= 9 * GIB < 15 * 640 * MIB  # the fifteenth does not fit


def test_mean_1200_of_4096_reserved_uses_187_5_mib_of_640_mib() -> None:
    plan = sizing.reservation_plan(WORKED_BPT, 4096, 1200, users=10)
    assert plan.used_bytes == 187.5 * MIB
    assert plan.reserved_bytes == 640 * MIB
    assert format_bytes(plan.used_bytes) == "187.5 MiB"


def test_worst_case_reservation_utilization_is_29_percent() -> None:
    plan = sizing.reservation_plan(WORKED_BPT, 4096, 1200, users=10)
    assert plan.utilization == 1200 / 4096
    assert round(plan.utilization * 100) == 29


def test_about_4_4_gib_of_6_25_gib_idle_for_ten_users() -> None:
    plan = sizing.reservation_plan(WORKED_BPT, 4096, 1200, users=10)
    assert plan.idle_total == 10 * (640 - 187.5) * MIB
    assert round(plan.idle_total / GIB, 1) == 4.4
    assert plan.idle_total + plan.used_total == plan.reserved_total


def test_16_token_blocks_waste_at_most_15_tokens_about_2_3_mib_per_request() -> None:
    waste = sizing.tail_waste_bytes(WORKED_BPT, 16)
    assert waste == 15 * 160 * KIB
    assert round(waste / MIB, 1) == 2.3
    # A request whose length is one past a block boundary really does leave 15 empty slots.
    assert sizing.blocks_per_sequence(1201, 16) * 16 - 1201 == 15


def test_8b_model_weighs_16_gb_bf16_8_gb_int8_4_gb_4bit() -> None:
    params = 8e9
    assert sizing.weight_bytes(params, "bf16") == 16e9
    assert sizing.weight_bytes(params, "int8") == 8e9
    assert sizing.weight_bytes(params, "int4") == 4e9
    # Scales come on top where they apply: one bf16 scale per 128 int4 weights adds P/64 bytes.
    assert sizing.weight_bytes(params, "int4", group_size=128) == 4e9 + 8e9 / 128 * 2
    assert sizing.weight_bytes(params, "bf16", group_size=128) == 16e9


def test_4_gb_model_at_1008_gb_per_s_decodes_at_most_252_tokens_per_s() -> None:
    assert sizing.decode_tokens_per_s(1008e9, sizing.weight_bytes(8e9, "int4")) == 252.0
    # Long contexts add their KV to every step's reads, so the bound falls.
    assert sizing.decode_tokens_per_s(1008e9, 4e9, 128 * KIB, 8192) < 252.0


def test_8b_class_kv_is_128_kib_per_token_bf16_and_a_quarter_at_4bit() -> None:
    bf16 = sizing.kv_bytes_per_token(32, 8, 128, sizing.kv_element_bytes("bf16"))
    int4 = sizing.kv_bytes_per_token(32, 8, 128, sizing.kv_element_bytes("int4"))
    assert bf16 == 128 * KIB
    assert int4 == 32 * KIB == bf16 / 4


def test_mm1_wait_97_ms_rises_to_about_850_ms_when_30_percent_of_capacity_is_removed() -> None:
    rho, service = queueing.solve_mm1_from_waits(0.097, 0.850, 0.30)
    print(f"solved M/M/1: utilization {rho:.4f}, service time {service * 1e3:.2f} ms")
    assert rho == pytest.approx(0.6416, abs=1e-4)
    assert service == pytest.approx(0.05419, abs=1e-5)
    drop = queueing.capacity_drop(rho / service, service, servers=1, loss_fraction=0.30)
    assert drop.before.mean_wait == pytest.approx(0.097, rel=1e-9)
    assert drop.after.mean_wait == pytest.approx(0.850, rel=1e-9)
    assert drop.after.utilization == pytest.approx(rho / 0.7)
    # The same pool with its figures rounded the way people say them: 64%, 54 ms.
    rounded = queueing.capacity_drop(0.64 / 0.054, 0.054, servers=1, loss_fraction=0.30)
    assert round(rounded.before.mean_wait * 1e3) == 96
    assert 800 < rounded.after.mean_wait * 1e3 < 850


def test_many_seat_pool_losing_30_percent_goes_unbounded_and_shedding_restores_it() -> None:
    drop = queueing.capacity_drop(arrival_rate=80.0, service_time=0.1, servers=10, loss_fraction=0.30)
    assert drop.before.utilization == pytest.approx(0.8)
    assert drop.after.servers == 7
    assert drop.after.utilization > 1 and math.isinf(drop.after.mean_wait)
    assert drop.shed_to_stay_bounded == pytest.approx(10.0)
    assert drop.shed_to_recover == pytest.approx(80 - 0.8 * 70)
