"""Fault injection into tiny data stages, in process: ingest (its Parquet output and rejects file),
vocab (its safetensors output) and regenerate (its journal, then the artifact assembled from it)
fail their k-th write, fsync or rename with ENOSPC or EIO, for every k the run makes
(support.iofaults counts Python's, pyarrow's and safetensors' writes in one sequence).

After each failure: the error names a file of the run (DiskFull for a full disk, exit 7 at the
command); the output is absent or whole (never torn); no temporary file is left; and the same
command run again finishes with the output a run without faults gives. For regenerate, every
journal line kept is a whole answer, the rerun asks none of them again, and every sample is in
the published artifact, none lost, none twice.
"""

from __future__ import annotations

import errno
import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from safetensors.numpy import load_file

from eagle3_data.config import IngestConfig, RegenerateConfig, SamplingConfig, VocabConfig
from eagle3_data.ingest import run as ingest
from eagle3_data.journal import read_journal
from eagle3_data.regenerate import run as regenerate
from eagle3_data.vocab import run as vocab
from eagle3_schemas import validate
from eagle3_schemas.io.diskspace import DiskFull
from eagle3_schemas.layouts.conversations import iter_rows

from support import fixtures
from support.iofaults import count_calls, failing, leftovers

CODES = [errno.ENOSPC, errno.EIO]


def _named_file(error: BaseException, files: list[Path]) -> None:
    """``error`` is the named one a fault of the run raises: it names one of ``files``."""
    assert isinstance(error, DiskFull | OSError), repr(error)
    if isinstance(error, OSError) and not isinstance(error, DiskFull):
        assert error.errno == errno.EIO, error
    assert any(str(f) in str(error) for f in files), error
    assert "injected" in str(error), error


def _each_fault(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    make: Callable[[Path], tuple[Callable[[], Any], list[Path]]],
    check: Callable[[Path, list[str], int], None],
) -> int:
    """Run ``make(folder)``'s stage in a fresh folder once per k and errno, failing there; then
    ``check(folder, calls made, errno)``. Returns the number of calls a clean run makes."""
    clean, _ = make(tmp_path / "clean")
    n = count_calls(clean, monkeypatch)
    for code in CODES:
        for k in range(n):
            folder = tmp_path / f"{code}-{k}"
            stage, files = make(folder)
            with failing(monkeypatch, k, code) as seen, pytest.raises(Exception) as raised:
                stage()
            _named_file(raised.value, files)
            assert not leftovers(folder), seen
            check(folder, seen, code)
    return n


# ---- ingest -------------------------------------------------------------------------------------


def _chats(folder: Path) -> Path:
    folder.mkdir(parents=True)
    lines = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(5)
    ]
    text = "\n".join(json.dumps(x) for x in lines) + '\n{"messages": 1}\nnot json\n'
    (folder / "chats.jsonl").write_text(text, encoding="utf-8")
    return folder / "chats.jsonl"


def test_ingest_every_fault(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def config(folder: Path) -> IngestConfig:
        return IngestConfig([folder / "chats.jsonl"], folder / "c.parquet", folder / "r.jsonl")

    def make(folder: Path) -> tuple[Callable[[], Any], list[Path]]:
        _chats(folder)
        return lambda: ingest(config(folder)), [folder / "c.parquet", folder / "r.jsonl"]

    reference = tmp_path / "reference"
    _chats(reference)
    ingest(config(reference))
    rows = pq.read_table(reference / "c.parquet").to_pylist()

    def check(folder: Path, seen: list[str], code: int) -> None:
        out = folder / "c.parquet"
        if out.exists():  # only where the fault hit after its rename: whole, valid
            assert seen[-1] == "fsync" and "replace" in seen, seen
            assert pq.read_table(out).to_pylist() == rows and validate(out) == []
            return
        ingest(config(folder))  # the same command again, room (or the device) back
        assert pq.read_table(out).to_pylist() == rows and validate(out) == []
        assert len((folder / "r.jsonl").read_text().splitlines()) == 2

    assert _each_fault(monkeypatch, tmp_path, make, check) >= 6


# ---- vocab --------------------------------------------------------------------------------------


def _tokenized(folder: Path) -> Path:
    folder.mkdir(parents=True)
    return fixtures.tokenized(folder / "tok.parquet")


def test_vocab_every_fault(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def config(folder: Path) -> VocabConfig:
        return VocabConfig(folder / "tok.parquet", folder / "v.safetensors", draft_vocab_size=8)

    def make(folder: Path) -> tuple[Callable[[], Any], list[Path]]:
        _tokenized(folder)
        return lambda: vocab(config(folder)), [folder / "v.safetensors"]

    reference = tmp_path / "reference"
    _tokenized(reference)
    vocab(config(reference))
    expected = load_file(reference / "v.safetensors")

    def check(folder: Path, seen: list[str], code: int) -> None:
        out = folder / "v.safetensors"
        if not out.exists():
            vocab(config(folder))
        got = load_file(out)
        assert sorted(got) == sorted(expected)
        assert all(np.array_equal(got[k], expected[k]) for k in got)

    _each_fault(monkeypatch, tmp_path, make, check)


# ---- regenerate ----------------------------------------------------------------------------------


class _Endpoint:
    """An OpenAI-compatible endpoint on loopback answering each question "answer to <q>"."""

    def __init__(self) -> None:
        self.asked: Counter[str] = Counter()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                question = body["messages"][-1]["content"]
                endpoint.asked[question] += 1
                message = {"role": "assistant", "content": f"answer to {question}"}
                if question == "q2":  # one sample the target answers badly: rejected for good
                    message["content"] = ""
                reply = {"choices": [{"message": message, "finish_reason": "stop"}]}
                payload = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"


@pytest.fixture
def endpoint() -> Iterator[_Endpoint]:
    served = _Endpoint()
    thread = threading.Thread(target=served.server.serve_forever, daemon=True)
    thread.start()
    yield served
    served.server.shutdown()
    served.server.server_close()


N = 5


def test_regenerate_every_fault(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, endpoint: _Endpoint, write_conversations
) -> None:
    chats = [
        [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"old {i}"}]
        for i in range(N)
    ]

    def config(folder: Path) -> RegenerateConfig:
        folder.mkdir(parents=True, exist_ok=True)
        source = folder / "c.parquet"
        if not source.exists():
            write_conversations(source, chats)
        return RegenerateConfig(
            source,
            folder / "regen.parquet",
            folder / "regen.rejects.jsonl",
            model="tiny",
            endpoint=endpoint.url,
            concurrency=1,  # one order of writes, the same on every run
            retries=0,
            timeout_s=10.0,
            backoff_s=0.01,
            sampling=SamplingConfig(max_tokens=16),
        )

    def make(folder: Path) -> tuple[Callable[[], Any], list[Path]]:
        c = config(folder)
        return lambda: regenerate(c), [c.output, c.journal, c.rejects, c.rejects.parent]

    reference = config(tmp_path / "reference")
    regenerate(reference)
    rows = list(iter_rows(reference.output))
    assert [r["messages"][-1]["content"] for r in rows] == [
        f"answer to q{i}" for i in range(N) if i != 2
    ]

    def check(folder: Path, seen: list[str], code: int) -> None:
        c = config(folder)
        if c.output.exists():  # the fault hit the folder's fsync after the artifact's rename
            assert seen[-1] == "fsync", seen
            assert list(iter_rows(c.output)) == rows and validate(c.output) == []
            return
        kept = read_journal(c.journal) if c.journal.exists() else {}
        lines = c.journal.read_bytes().splitlines(keepends=True) if kept else []
        asked = endpoint.asked.copy()
        summary = regenerate(c)  # the same command again: resumes from the journal
        assert summary.published and summary.already_done == len(kept), summary
        assert list(iter_rows(c.output)) == rows and validate(c.output) == []
        assert not c.journal.exists()
        again = endpoint.asked - asked
        # the rerun asks each sample the journal lacks, once, and none it holds
        assert sum(again.values()) == N - len(kept), (again, kept)
        assert all(n == 1 for n in again.values()), again
        rejects = [json.loads(x) for x in c.rejects.read_text().splitlines()]
        assert [r["reason"].split(":")[0] for r in rejects] == ["empty_answer"], rejects
        for line in lines:  # each complete line the fault left is a whole entry of a sample
            if line.endswith(b"\n"):
                entry = json.loads(line)
                assert "messages" in entry or "rejected" in entry, entry

    assert _each_fault(monkeypatch, tmp_path, make, check) >= N + 4


# ---- the command's exit status -------------------------------------------------------------------


@pytest.mark.parametrize("command", ["ingest", "vocab"])
def test_a_full_disk_at_an_artifact_exits_7_naming_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    """pyarrow's OSError and safetensors' SafetensorError for a full disk reached the command
    as they were: a traceback, exit 1, no file named. Now DiskFull: exit 7 naming the file."""
    from eagle3_data.cli import main

    if command == "ingest":
        argv = ["ingest", str(_chats(tmp_path / "in")), "--out", str(tmp_path / "c.parquet")]
        first = "parquet write"
    else:
        argv = ["vocab", str(_tokenized(tmp_path / "in")), "--out", str(tmp_path / "v.safetensors")]
        argv += ["--draft-vocab-size", "8"]
        first = "safetensors write"
    out = Path(argv[argv.index("--out") + 1])
    with failing(monkeypatch, -1, 0) as seen:
        assert main(argv) == 0
    out.unlink()
    k = seen.index(first)  # the artifact's first write
    capsys.readouterr()
    with failing(monkeypatch, k, errno.ENOSPC):
        assert main(argv) == 7
    err = capsys.readouterr().err
    assert f"eagle3-data {command}: disk full: {out}: no room for this file" in err, err
    assert "No space left on device" in err and "rerun the same command" in err
    assert not out.exists() and not leftovers(tmp_path)
