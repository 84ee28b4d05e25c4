"""The row checksum's candidates: each one's speed on one core and what it guarantees (why
hidden_states v2 hashes with XXH3-128; its speed in recipes/*/RESOURCES.md "validation").

    uv run tools/bench/bench_checksum.py              # results as JSON on stdout
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import timeit
import zlib

import numpy as np
import xxhash

# name: (digest of a buffer, what it guarantees)
CANDIDATES = {
    "blake2b-128": (
        lambda b: hashlib.blake2b(b, digest_size=16).digest(),
        "cryptographic (collision/preimage resistant); hashlib; hidden_states v1",
    ),
    "sha256": (
        lambda b: hashlib.sha256(b).digest(),
        "cryptographic; hashlib (SHA-NI where the CPU has it)",
    ),
    "xxh3_128": (
        lambda b: xxhash.xxh3_128(b).digest(),
        "non-cryptographic, 128-bit, passes SMHasher; detects accidental change, not forgery; pip 'xxhash' (Cyan4973/xxHash, used by zstd and lz4 frames); hidden_states v2",
    ),
    "crc32": (zlib.crc32, "non-cryptographic, 32-bit: too short to key 10^8 rows on; zlib"),
}
try:
    import blake3

    CANDIDATES["blake3"] = (
        lambda b: blake3.blake3(b).digest(),
        "cryptographic, SIMD and tree-parallel; Rust crate, pip 'blake3' (not a dependency)",
    )
except ImportError:
    pass


def bench_hashes(mib: int) -> dict:
    """Each candidate's throughput on one core over the same bytes (best of 3)."""
    data = memoryview(np.random.default_rng(0).integers(0, 256, mib << 20, dtype=np.uint8))
    out = {}
    for name, (digest, guarantees) in CANDIDATES.items():
        digest(data[: 1 << 20])
        best = min(timeit.repeat(lambda d=digest: d(data), number=1, repeat=3))
        out[name] = {"GiB_per_s_one_core": round(mib / 1024 / best, 2), "guarantees": guarantees}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes hashed per candidate")
    args = parser.parse_args(argv)
    print(json.dumps(bench_hashes(args.mib), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
