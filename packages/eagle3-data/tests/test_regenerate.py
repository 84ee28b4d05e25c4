"""regenerate against a real HTTP server on loopback that misbehaves on purpose.

The endpoint is the one thing truly outside the project, so a local server plays its failure
modes (timeouts, 5xx, malformed bodies, truncated answers, refusals); everything on our side
(client, retries, journal, publication) runs for real.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eagle3_data.config import RegenerateConfig, SamplingConfig
from eagle3_data.journal import read_journal
from eagle3_data.regenerate import run
from eagle3_schemas import read_header, validate
from eagle3_schemas.io.atomic import TEMP_MARKER
from eagle3_schemas.layouts.conversations import iter_rows

from support.failures import failure_report
from support.smallfs import leave_free, small_tmpfs


@dataclass
class Script:
    """How the fake endpoint answers, keyed by the last user message."""

    fail_first: dict[str, int] = field(default_factory=dict)  # 503 this many times, then answer
    always: dict[str, int] = field(default_factory=dict)  # always this status
    bodies: dict[str, bytes] = field(
        default_factory=dict
    )  # body of that status (default: scripted)
    sleep_first: dict[str, float] = field(default_factory=dict)  # first request hangs this long
    truncated: set[str] = field(default_factory=set)
    malformed_first: set[str] = field(default_factory=set)
    delay: float = 0.0
    requests: Counter[str] = field(default_factory=Counter)
    histories: list[list[dict[str, str]]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _handler(script: Script) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            messages = body["messages"]
            key = messages[-1]["content"]
            with script.lock:
                script.requests[key] += 1
                n = script.requests[key]
                script.histories.append(messages)
                script.in_flight += 1
                script.max_in_flight = max(script.max_in_flight, script.in_flight)
            try:
                time.sleep(script.delay)
                if n == 1 and key in script.sleep_first:
                    time.sleep(script.sleep_first[key])
                if key in script.always:
                    body = script.bodies.get(key, b'{"error": "scripted"}')
                    return self._send(script.always[key], body)
                if n <= script.fail_first.get(key, 0):
                    return self._send(503, b'{"error": "overloaded"}')
                if n == 1 and key in script.malformed_first:
                    return self._send(200, b'{"choices": []}')
                finish = "length" if key in script.truncated else "stop"
                answer = {
                    "choices": [
                        {
                            "message": {"role": "assistant", "content": f"answer to {key}"},
                            "finish_reason": finish,
                        }
                    ]
                }
                self._send(200, json.dumps(answer).encode())
            finally:
                with script.lock:
                    script.in_flight -= 1

        def _send(self, status: int, payload: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    return Handler


@pytest.fixture
def endpoint() -> Iterator[tuple[str, Script]]:
    script = Script()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(script))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", script
    server.shutdown()
    server.server_close()


def _conversations(n: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"old answer {i}"}]
        for i in range(n)
    ]


def _answered(i: int) -> list[dict[str, str]]:
    """Conversation ``i`` of ``_conversations`` as the scripted endpoint regenerates it."""
    return [
        {"role": "user", "content": f"q{i}"},
        {"role": "assistant", "content": f"answer to q{i}"},
    ]


def _config(tmp_path: Path, source: Path, url: str, **kw: object) -> RegenerateConfig:
    defaults = dict(
        model="tiny",
        endpoint=url,
        concurrency=3,
        retries=3,
        timeout_s=2.0,
        backoff_s=0.01,
        sampling=SamplingConfig(max_tokens=64),
    )
    return RegenerateConfig(
        source, tmp_path / "regen.parquet", tmp_path / "regen.rejects.jsonl", **{**defaults, **kw}
    )  # type: ignore[arg-type]


def _command(source: Path, out: Path, url: str, concurrency: int) -> list[str]:
    """``eagle3-data regenerate`` of ``source`` into ``out`` through the endpoint at ``url``, in
    an interpreter of its own."""
    command = [sys.executable, "-m", "eagle3_data", "regenerate", str(source)]
    command += ["--out", str(out), "--model", "tiny", "--endpoint", url]
    return [*command, "--concurrency", str(concurrency), "--backoff", "0.01"]


def _wait_for_lines(journal: Path, count: int, poll: float) -> None:
    """Until ``journal`` holds ``count`` lines (answers journaled), 60 s at the most."""
    deadline = time.monotonic() + 60
    while (
        not journal.exists() or journal.read_text().count("\n") < count
    ) and time.monotonic() < deadline:
        time.sleep(poll)


def test_recovers_from_5xx_timeouts_and_malformed_bodies(
    endpoint, tmp_path: Path, write_conversations
) -> None:
    url, script = endpoint
    multi_turn = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "m1"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "m2"},
        {"role": "assistant", "content": "y"},
    ]
    source = write_conversations(tmp_path / "c.parquet", [*_conversations(6), multi_turn])
    script.fail_first = {"q1": 2, "q2": 3}
    script.sleep_first = {"q3": 3.0}  # past the 2 s client timeout once
    script.malformed_first = {"q4"}
    script.truncated = {"q5"}
    summary = run(_config(tmp_path, source, url))
    assert (
        summary.published
        and summary.regenerated == 6
        and summary.rejected == 1
        and summary.failed == 0
    )
    out = tmp_path / "regen.parquet"
    assert validate(out) == []
    rows = list(iter_rows(out))
    assert [r["messages"][-1]["content"] for r in rows[:5]] == [
        f"answer to q{i}" for i in (0, 1, 2, 3, 4)
    ]
    # turn by turn: the second question is asked after the regenerated first answer
    assert rows[5]["messages"] == [
        multi_turn[0],
        multi_turn[1],
        {"role": "assistant", "content": "answer to m1"},
        multi_turn[3],
        {"role": "assistant", "content": "answer to m2"},
    ]
    assert next(
        [m["content"] for m in h] for h in script.histories if h[-1]["content"] == "m2"
    ) == [
        "sys",
        "m1",
        "answer to m1",
        "m2",
    ]
    rejected = [
        json.loads(line) for line in (tmp_path / "regen.rejects.jsonl").read_text().splitlines()
    ]
    assert [(r["source"], r["reason"].split(":")[0]) for r in rejected] == [("test:5", "truncated")]
    header = read_header(out)
    assert (
        header.lineage["generator"].startswith("sha256:")
        and header.fields["regeneration"]["sampling"]["max_tokens"] == 64
    )
    assert script.max_in_flight <= 3
    assert not (tmp_path / "regen.parquet.journal.jsonl").exists()


def test_persistent_failure_is_not_published_and_a_rerun_resumes(
    endpoint, tmp_path: Path, write_conversations
) -> None:
    url, script = endpoint
    source = write_conversations(tmp_path / "c.parquet", _conversations(5))
    script.always = {
        "q2": 503,
        "q3": 400,
    }  # 503 is retried, 400 is not; both leave the sample to a rerun
    summary = run(_config(tmp_path, source, url))
    assert not summary.published and summary.failed == 2 and summary.regenerated == 3
    assert not (tmp_path / "regen.parquet").exists()
    assert script.requests["q2"] == 4 and script.requests["q3"] == 1
    last_run = [
        json.loads(line)
        for line in (tmp_path / "regen.rejects.jsonl.last-run.jsonl").read_text().splitlines()
    ]
    assert sorted(r["reason"].split(":")[0] for r in last_run) == [
        "endpoint_failed",
        "endpoint_failed",
    ]
    script.always = {}
    summary = run(_config(tmp_path, source, url))
    assert summary.published and summary.already_done == 3 and summary.regenerated == 2
    assert all(
        script.requests[f"q{i}"] == 1 for i in (0, 1, 4)
    )  # done samples are never asked again
    assert pq.read_table(tmp_path / "regen.parquet").num_rows == 5


@pytest.mark.process
def test_kill_9_mid_run_then_rerun_completes_without_duplicates(
    endpoint, tmp_path: Path, write_conversations
) -> None:
    url, script = endpoint
    source = write_conversations(tmp_path / "c.parquet", _conversations(24))
    script.delay = 0.15
    out = tmp_path / "regen.parquet"
    command = _command(source, out, url, concurrency=2)
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        journal = tmp_path / "regen.parquet.journal.jsonl"
        _wait_for_lines(journal, 6, poll=0.05)
        proc.send_signal(signal.SIGKILL)
    done_before = journal.read_text().count("\n")
    assert 6 <= done_before < 24 and not out.exists()
    script.delay = 0.0
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = list(iter_rows(out))
    assert [r["id"] for r in rows] == pq.read_table(source).column("id").to_pylist()
    assert validate(out) == []
    repeated = [k for k, n in script.requests.items() if n > 1]
    assert len(repeated) <= 2, f"only requests in flight at the kill may repeat, got {repeated}"


def test_a_seeded_limit_regenerates_a_reproducible_random_subset(
    endpoint, tmp_path: Path, write_conversations
) -> None:
    """--limit N --sample-seed S asks the endpoint for exactly the N conversations the shared
    id-based draw picks (not the first N of a corpus sorted by source), and says so."""
    from eagle3_schemas.layouts.conversations import select_rows

    url, script = endpoint
    source = write_conversations(tmp_path / "c.parquet", _conversations(40))
    ids = pq.read_table(source, columns=["id"]).column("id").to_pylist()
    summary = run(_config(tmp_path, source, url, limit=8, sample_seed=3))
    assert summary.published and summary.regenerated == 8
    chosen = select_rows(ids, 8, 3)
    assert chosen != list(range(8))
    asked = sorted(int(h[-1]["content"][1:]) for h in script.histories)
    assert asked == chosen
    out = tmp_path / "regen.parquet"
    assert pq.read_table(out, columns=["id"]).column("id").to_pylist() == [ids[r] for r in chosen]
    selection = read_header(out).fields["regeneration"]["selection"]
    assert selection.startswith("8 rows at random: the smallest blake2b('3:' + id)")


def test_a_conversation_longer_than_the_served_context_is_rejected_not_retried_forever(
    endpoint, tmp_path: Path, write_conversations
) -> None:
    """vLLM answers 400 "maximum context length" for that sample alone: it is a final reject
    (too_long), and the artifact is published; any other 400 still leaves it to a rerun."""
    url, script = endpoint
    source = write_conversations(tmp_path / "c.parquet", _conversations(3))
    script.always = {"q1": 400}
    script.bodies = {
        "q1": b'{"object": "error", "message": "This model\'s maximum context length is 4096 '
        b'tokens. However, you requested 5000 tokens.", "type": "BadRequestError", "code": 400}'
    }
    summary = run(_config(tmp_path, source, url))
    assert summary.published and summary.regenerated == 2 and summary.rejected == 1
    assert script.requests["q1"] == 1
    rejected = [
        json.loads(line) for line in (tmp_path / "regen.rejects.jsonl").read_text().splitlines()
    ]
    assert [r["reason"].split(":")[0] for r in rejected] == ["too_long"]


@pytest.mark.process
def test_sigterm_keeps_every_answer_received_and_the_rerun_asks_nothing_twice(
    endpoint, tmp_path: Path, write_conversations
) -> None:
    """Preemption: the answers in flight are awaited and journaled, nothing new is asked, exit
    5; the rerun resumes and no conversation is asked twice (kill -9 may repeat those in
    flight)."""
    url, script = endpoint
    source = write_conversations(tmp_path / "c.parquet", _conversations(24))
    script.delay = 0.15
    out = tmp_path / "regen.parquet"
    command = _command(source, out, url, concurrency=3)
    journal = tmp_path / "regen.parquet.journal.jsonl"
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
        _wait_for_lines(journal, 6, poll=0.02)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 5, stderr.decode()[-2000:]
    assert "preempted by SIGTERM" in stderr.decode()
    answered = journal.read_text().count("\n")
    assert 6 <= answered < 24 and not out.exists()
    assert sum(script.requests.values()) == answered  # every answer received was kept
    script.delay = 0.0
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = list(iter_rows(out))
    assert [r["id"] for r in rows] == pq.read_table(source).column("id").to_pylist()
    # each row holds the answer the endpoint gave, whichever run received it
    assert [r["messages"] for r in rows] == [_answered(i) for i in range(24)]
    assert validate(out) == []
    assert max(script.requests.values()) == 1  # nothing asked twice


@pytest.mark.tmpfs
def test_a_full_disk_while_journaling_stops_by_name_and_the_rerun_resumes(
    endpoint, tmp_path: Path, write_conversations
) -> None:
    """On a real tmpfs with one page (4 KiB) left for the journal: the entry that does not fit
    stops the run (exit 7, the journal's path named), the entries before it are kept whole and
    the one cut short by ENOSPC is ignored; once space is freed the same command drops that
    torn line, asks only what the journal lacks and publishes every answer."""
    url, script = endpoint
    source = write_conversations(tmp_path / "c.parquet", _conversations(60))
    ids = pq.read_table(source).column("id").to_pylist()
    with small_tmpfs(tmp_path / "small", size_mib=1) as disk:
        out = disk / "regen.parquet"
        journal = disk / "regen.parquet.journal.jsonl"
        command = _command(source, out, url, concurrency=2)
        filler = leave_free(disk, 4096)
        stopped = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert stopped.returncode == 7, failure_report(stopped.stderr)
        assert f"{journal}: no room for the journal entry of sample" in stopped.stderr
        assert "No space left on device" in stopped.stderr
        data = journal.read_bytes()
        assert len(data) == 4096 and not data.endswith(b"\n")  # ENOSPC cut the last line
        whole = [json.loads(line) for line in data.split(b"\n")[:-1]]
        assert 20 <= len(whole) < 60 and not out.exists()
        assert list(read_journal(journal)) == [e["id"] for e in whole]  # the torn one ignored
        for entry in whole:  # what was kept is the endpoint's answer, whole
            assert entry["messages"] == _answered(ids.index(entry["id"]))
        asked_before = sum(script.requests.values())

        filler.unlink()
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, failure_report(done.stderr)
        assert "dropping a torn last line" in done.stderr
        rows = list(iter_rows(out))
        assert [r["id"] for r in rows] == ids
        assert [r["messages"] for r in rows] == [_answered(i) for i in range(60)]
        assert validate(out) == [] and not journal.exists()
        kept = {ids.index(e["id"]) for e in whole}
        assert all(script.requests[f"q{i}"] == 1 for i in kept)  # never asked again
        # the rerun asked each sample the journal lacked once; the first run asked at most
        # the journal's entries, the torn one and those in flight beside it
        assert sum(script.requests.values()) - asked_before == 60 - len(whole)
        assert asked_before - len(whole) <= 2  # concurrency 2


@pytest.mark.tmpfs
def test_a_full_disk_while_publishing_stops_by_name_and_the_rerun_publishes_from_the_journal(
    endpoint, tmp_path: Path, write_conversations
) -> None:
    """Every answer is journaled, but the artifact does not fit beside the journal: the run stops
    (exit 7) naming the output, leaves neither the artifact nor its temporary file and keeps the
    journal whole; once space is freed the same command publishes from the journal, asking the
    endpoint nothing again."""
    url, script = endpoint
    n = 400
    source = write_conversations(tmp_path / "c.parquet", _conversations(n))

    def command(out: Path) -> list[str]:
        return _command(source, out, url, concurrency=4)

    # the artifact and the journal's sizes, from a run on the roomy disk
    reference = tmp_path / "reference.parquet"
    assert subprocess.run(command(reference), capture_output=True, timeout=120).returncode == 0
    rows = list(iter_rows(reference))  # the turns as journaled: only the fields they have
    journal_bytes = sum(
        len(json.dumps({"id": r["id"], "messages": r["messages"]}, ensure_ascii=False)) + 1
        for r in rows
    )
    page = 4096
    artifact_pages = reference.stat().st_size // page
    assert artifact_pages >= 3, reference.stat().st_size  # room to fall short of it
    with small_tmpfs(tmp_path / "small", size_mib=2) as disk:
        out = disk / "regen.parquet"
        journal = disk / "regen.parquet.journal.jsonl"
        # the journal's pages, and one page short of half the artifact's beside them
        filler = leave_free(disk, -(-journal_bytes // page) * page + artifact_pages // 2 * page)
        stopped = subprocess.run(command(out), capture_output=True, text=True, timeout=120)
        assert stopped.returncode == 7, failure_report(stopped.stderr)
        assert f"{out}: no room for the regenerated conversations" in stopped.stderr
        assert "rerun the same command to resume" in stopped.stderr
        assert not out.exists() and not [p for p in disk.iterdir() if TEMP_MARKER in p.name]
        assert len(read_journal(journal)) == n  # every answer kept, whole
        asked = sum(script.requests.values())

        filler.unlink()
        done = subprocess.run(command(out), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, failure_report(done.stderr)
        assert sum(script.requests.values()) == asked  # published from the journal alone
        assert list(iter_rows(out)) == rows
        assert validate(out) == [] and not journal.exists()
