"""``pagedserve bench …``: every benchmark and the standard-model builder."""

from __future__ import annotations

import importlib

# Each module exposes add_parser(bench_subparsers).
BENCHMARKS = [
    "pagedserve.bench.make_model",
    "pagedserve.bench.throughput",
    "pagedserve.bench.decode",
    "pagedserve.bench.head_screen",
    "pagedserve.bench.pool_reuse",
    "pagedserve.bench.sampler",
    "pagedserve.bench.gguf_kernels",
    "pagedserve.bench.spec",
    "pagedserve.bench.compare",
    "pagedserve.bench.seats",
    "pagedserve.bench.prefix",
    "pagedserve.bench.serve",
    "pagedserve.bench.tiers",
    "pagedserve.bench.dashboard",
    "pagedserve.bench.quality",
    "pagedserve.bench.retrieval",
    "pagedserve.bench.train",
    "pagedserve.bench.gpu_report",
]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks (W1-W6 of docs/WORKLOADS.md) and standard-model building",
                              description="Benchmarks that print ratios against a baseline measured in the same run.")
    bench = p.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    for module in BENCHMARKS:
        importlib.import_module(module).add_parser(bench)
