"""`python -m bench NAME [options]`: run one benchmark. `python -m bench` lists them."""
from __future__ import annotations

import importlib
import sys

# name -> module with `main(argv) -> int`; add a benchmark by adding a line
BENCHMARKS = {
    "memory": "bench.memory",
    "malloc": "bench.malloc",
    "params": "bench.params",
    "inference": "bench.inference",
    "planning": "bench.planning",
    "tiling": "bench.tiling",
    "access": "bench.access",
    "training": "bench.training",
    "tokens": "bench.tokens",
    "soak": "bench.soak",
    "integrity": "bench.integrity",
    "scale": "bench.scale",
    "diskio": "bench.diskio",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown benchmark {argv[0]!r}", file=sys.stderr)
        print("usage: python -m bench NAME [options]   (python -m bench NAME --help for its options)")
        print("benchmarks: " + ", ".join(sorted(BENCHMARKS)))
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(BENCHMARKS[argv[0]])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
