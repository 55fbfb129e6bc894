"""A synthetic neighbour for the cores: a loop that is busy BUSY_MS, then asleep IDLE_MS, for
SECONDS. `1 4` takes a fifth of one core, like a load generator parsing a stream of SSE events
(docs/BENCHMARKS.md, "W4b on an Ice Lake Xeon").

Usage: python examples/cpu_neighbour.py BUSY_MS IDLE_MS SECONDS
"""

import sys
import time


def main() -> None:
    busy, idle, seconds = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3, float(sys.argv[3])
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        while time.perf_counter() - start < busy:
            pass
        time.sleep(idle)


if __name__ == "__main__":
    main()
