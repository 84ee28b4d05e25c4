"""tokenize: conversations → token ids and assistant-only loss masks, in parallel processes.

Two ways, chosen per row:

- An instant row without tools (every conversations v1 row) is rendered whole and every
  assistant turn's span is trained, exactly as before conversations v2.
- A thinking-mode row, or one with tools or tool calls, becomes one sample per generation event
  (assistant turn), because templates drop earlier turns' reasoning (Kimi's renders a whole
  conversation without any): the prompt as served (template, tools, mode, generation prompt),
  loss 0, then the completion, loss 1, which covers the reasoning, ``</think>``, the tool-call
  markers and the end token. The ids are the target's own where regeneration kept them
  (``prompt_token_ids``, ``completion_token_ids``); otherwise the prompt is rendered with the
  generation prompt and the completion is what the template renders after it, each tokenized
  on its own, so the mask ends exactly at the token boundary. Event k of row ID is sample
  ``ID#k``.

Truncation policy: a sample longer than ``max_length`` keeps its first ``max_length`` tokens
(the prefix, so the prompt survives); a sample left without any trained token is rejected.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from eagle3_data.config import TokenizeConfig
from eagle3_data.loss_mask import THINK_CLOSE, THINK_OPEN, ChatRenderer, MaskError, token_mask
from eagle3_data.rejects import RejectsFile
from eagle3_schemas.contract.header import make_header, parquet_stream, read_header
from eagle3_schemas.contract.lineage import (
    fingerprint_artifact,
    fingerprint_text,
    fingerprint_tokenizer_dir,
)
from eagle3_schemas.layouts.conversations import (
    iter_rows,
    render_prompt,
    served_messages,
    template_kwargs,
)
from eagle3_schemas.layouts.remote_code import remote_code_record
from eagle3_schemas.layouts.target_config import read_text_config

SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("num_tokens", pa.int32()),
        ("num_loss_tokens", pa.int32()),
    ]
)
TRUNCATION = "keep_prefix"
EMPTY_THINK = THINK_OPEN + THINK_CLOSE


@dataclass
class TokenizeSummary:
    written: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    truncated: int = 0
    events: int = 0  # samples written from generation events (thinking or agent rows)
    # trained tokens of the generation events by kind; whole-conversation rows count as answer
    loss_tokens_by_kind: dict[str, int] = field(
        default_factory=lambda: {"reasoning": 0, "tool_call": 0, "answer": 0}
    )
    rejected: dict[str, int] = field(default_factory=dict)


@dataclass
class Encoded:
    sample_id: str
    source: str
    input_ids: np.ndarray | None = None
    loss_mask: np.ndarray | None = None
    truncated: bool = False
    error: str | None = None
    messages: Any = None
    event: bool = False  # a generation event's sample (prompt, then completion)
    kinds: dict[str, int] | None = None


def load_tokenizer(directory: Path, trust_remote_code: bool = False) -> Any:
    """The target's tokenizer; custom code in ``directory`` runs only when trusted (checked
    before, by ``TokenizeConfig.check``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(directory), local_files_only=True, trust_remote_code=trust_remote_code
    )


def target_vocab_size(directory: Path, tokenizer: Any) -> int:
    """The target's vocabulary (embedding rows): config.json's when the directory has one."""
    config = directory / "config.json"
    size = read_text_config(directory)["vocab_size"] if config.is_file() else len(tokenizer)
    if len(tokenizer) > size:
        raise ValueError(
            f"{directory}: tokenizer has {len(tokenizer)} tokens but config.json vocab_size is {size}"
        )
    return int(size)


def spans_to_token_mask(encoding: Any, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for every token that overlaps a span: the tokens holding each span's first and last
    character and all between (as transformers turns generation tags into masks).

    Asking the Rust encoding for two tokens per span is far cheaper than converting every
    token's offsets to numpy; a span edge that maps to no token falls back to the offsets.
    """
    mask = np.zeros(len(encoding.ids), dtype=np.uint8)
    for a, b in spans:
        first, last = encoding.char_to_token(a), encoding.char_to_token(b - 1)
        if first is None or last is None:
            return token_mask(np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2), spans)
        mask[first : last + 1] = 1
    return mask


Row = tuple[str, str, list[dict[str, Any]]] | tuple[str, str, list[dict[str, Any]], str, str]


def is_event_row(messages: list[dict[str, Any]], tools: str, mode: str) -> bool:
    """Whether a row is tokenized per generation event: thinking mode, tools declared, or any
    turn beyond role and content. Every other row is tokenized whole, as before v2."""
    return mode == "thinking" or tools != "[]" or any(len(m) != 2 for m in messages)


def encode_batch(renderer: ChatRenderer, rows: list[Row], max_length: int) -> list[Encoded]:
    """Render, locate trained spans and tokenize ``(id, source, messages[, tools, mode])`` rows
    in one batch."""
    results: list[Encoded] = []
    pending: list[tuple[Encoded, list[tuple[int, int]], str]] = []
    for sample_id, source, messages, *rest in rows:
        tools, mode = rest if rest else ("[]", "instant")
        if is_event_row(messages, tools, mode):
            results += encode_events(renderer, sample_id, source, messages, tools, mode, max_length)
            continue
        text = renderer.render(messages)
        try:
            spans = renderer.trained_spans(messages, text)
        except MaskError as e:
            results.append(Encoded(sample_id, source, error=str(e), messages=messages))
            continue
        encoded = Encoded(sample_id, source, messages=messages)
        results.append(encoded)
        pending.append((encoded, spans, text))
    if not pending:
        return results
    if getattr(renderer.tokenizer, "is_fast", False):
        # The Rust tokenizer directly: transformers' per-sample Python conversion of offsets
        # would cost a quarter of the whole encode.
        encodings = renderer.tokenizer.backend_tokenizer.encode_batch(
            [text for _, _, text in pending], add_special_tokens=False
        )
        masked = [
            (np.asarray(encoding.ids, dtype=np.int32), spans_to_token_mask(encoding, spans))
            for (_, spans, _), encoding in zip(pending, encodings, strict=True)
        ]
    else:
        masked = [
            encode_without_offsets(renderer.tokenizer, text, spans) for _, spans, text in pending
        ]
    for (encoded, _, _), result in zip(pending, masked, strict=True):
        if isinstance(result, str):
            encoded.error = result
            continue
        ids_array, mask = result
        encoded.truncated = len(ids_array) > max_length
        ids_array, mask = ids_array[:max_length], mask[:max_length]
        if not mask.any():
            encoded.error = (
                "no_loss_tokens: every assistant token lies beyond max_length"
                if encoded.truncated
                else "no_loss_tokens: no assistant token in the rendered sample"
            )
            continue
        encoded.input_ids, encoded.loss_mask, encoded.messages = ids_array, mask, None
    return results


def event_texts(
    renderer: ChatRenderer, messages: list[dict[str, Any]], turn: int, tools: str, mode: str
) -> tuple[str, str]:
    """(prompt, completion) of the generation event at assistant turn ``turn``, as rendered.

    The prompt is the conversation before the turn with the generation prompt; the completion is
    what the template renders after it for the turn, up to its closing. A template that drops
    the turn's reasoning where it ends the conversation (Kimi's renders ``<think></think>``
    there) gets the reasoning put back before its ``</think>``: that is what the target
    produced after the prompt's ``<think>``.
    """
    prompt = render_prompt(renderer.tokenizer, messages[:turn], tools, mode)
    # The turn itself keeps its calls' arguments as written: that text is the completion.
    full = renderer.tokenizer.apply_chat_template(
        [*served_messages(messages[:turn]), messages[turn]],
        tokenize=False,
        add_generation_prompt=False,
        **template_kwargs(tools, mode),
    )
    if not full.startswith(prompt) and prompt.endswith(THINK_OPEN) and EMPTY_THINK in full:
        # Kimi's split: this turn ends the agent loop, so rendered through it every earlier turn
        # is history and loses its reasoning, while its prompt (as served) keeps them. What the
        # target produced after the prompt's <think> is the turn's own tail.
        full = prompt + full[full.rindex(EMPTY_THINK) + len(THINK_OPEN) :]
    if not full.startswith(prompt):
        raise MaskError(
            f"template_mismatch: assistant turn {turn}: the conversation rendered through this "
            "turn does not start with its prompt rendered with the generation prompt"
        )
    completion = full[len(prompt) :]
    if renderer.closing:
        end = completion.rfind(renderer.closing)
        if end < 0:
            raise MaskError(
                f"template_mismatch: assistant turn {turn}: no {renderer.closing!r} closes it"
            )
        completion = completion[: end + len(renderer.closing)]
    reasoning = messages[turn].get("reasoning_content")
    if reasoning and reasoning not in completion:
        if not completion.startswith(THINK_CLOSE):
            raise MaskError(
                f"reasoning_dropped: assistant turn {turn}: the template renders none of its "
                "reasoning_content and its generation prompt leaves no open think block"
            )
        completion = reasoning + completion
    return prompt, completion


def _encode_text(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def loss_kinds(tokenizer: Any, completion: list[int]) -> dict[str, int]:
    """Completion tokens by kind: reasoning (through the first ``</think>``), tool_call (from
    the first tool-call opening marker through the last closing one), answer (the rest)."""
    vocab = tokenizer.get_vocab()
    think_close = vocab.get(THINK_CLOSE)
    opens = {vocab[t] for t in ("<|tool_calls_section_begin|>", "<tool_call>") if t in vocab}
    closes = {vocab[t] for t in ("<|tool_calls_section_end|>", "</tool_call>") if t in vocab}
    reasoning = completion.index(think_close) + 1 if think_close in completion else 0
    starts = [i for i, t in enumerate(completion) if t in opens and i >= reasoning]
    ends = [i for i, t in enumerate(completion) if t in closes]
    calls = ends[-1] + 1 - starts[0] if starts and ends and ends[-1] >= starts[0] else 0
    return {
        "reasoning": reasoning,
        "tool_call": calls,
        "answer": len(completion) - reasoning - calls,
    }


def encode_events(
    renderer: ChatRenderer,
    sample_id: str,
    source: str,
    messages: list[dict[str, Any]],
    tools: str,
    mode: str,
    max_length: int,
) -> list[Encoded]:
    """One sample per assistant turn: prompt ids (loss 0), then completion ids (loss 1)."""
    out: list[Encoded] = []
    event = 0
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        encoded = Encoded(f"{sample_id}#{event}", source, messages=messages, event=True)
        event += 1
        out.append(encoded)
        if message.get("completion_token_ids") and message.get("prompt_token_ids"):
            prompt_ids = list(message["prompt_token_ids"])
            completion_ids = list(message["completion_token_ids"])
        else:
            try:
                prompt, completion = event_texts(renderer, messages, turn, tools, mode)
            except MaskError as e:
                encoded.error = str(e)
                continue
            prompt_ids = _encode_text(renderer.tokenizer, prompt)
            completion_ids = _encode_text(renderer.tokenizer, completion)
        ids = np.asarray(prompt_ids + completion_ids, dtype=np.int32)
        mask = np.concatenate(
            [np.zeros(len(prompt_ids), np.uint8), np.ones(len(completion_ids), np.uint8)]
        )
        encoded.truncated = len(ids) > max_length
        kept = max(0, min(len(completion_ids), max_length - len(prompt_ids)))
        if kept == 0:
            encoded.error = "no_loss_tokens: every completion token lies beyond max_length"
            continue
        encoded.kinds = loss_kinds(renderer.tokenizer, completion_ids[:kept])
        encoded.input_ids, encoded.loss_mask = ids[:max_length], mask[:max_length]
        encoded.messages = None
    return out


def encode_without_offsets(
    tokenizer: Any, text: str, spans: list[tuple[int, int]]
) -> tuple[np.ndarray, np.ndarray] | str:
    """Ids and mask from a tokenizer that reports no character offsets (a Python tokenizer, such
    as Kimi's TikToken one): the text is encoded in pieces cut at the span edges, and the pieces'
    ids must equal the whole text's ids — then every token lies inside one piece and the mask is
    exact. If a token straddles an edge the sample is rejected, never masked approximately.
    Templates put special tokens around each turn, so edges fall between tokens in practice."""
    whole = tokenizer.encode(text, add_special_tokens=False)
    edges = sorted({0, len(text), *(edge for span in spans for edge in span)})
    ids: list[int] = []
    mask: list[int] = []
    for a, b in itertools.pairwise(edges):
        piece = tokenizer.encode(text[a:b], add_special_tokens=False)
        trained = any(start <= a and b <= end for start, end in spans)
        ids += piece
        mask += [int(trained)] * len(piece)
    if ids != list(whole):
        return (
            "token_straddles_span: a token of the whole rendered text crosses the edge of an "
            "assistant turn, so no exact per-token mask exists for this tokenizer"
        )
    return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)


# ---- worker processes --------------------------------------------------------------------
# Workers are forked after the tokenizer is loaded and before any Parquet is read: they
# inherit it instead of importing transformers and parsing tokenizer.json again (seconds per
# worker), and no Rust or Arrow thread is running at fork time.
_worker: dict[str, Any] = {}


def _encode_chunk(rows: list[Row]) -> list[Encoded]:
    return encode_batch(_worker["renderer"], rows, _worker["max_length"])


def _chunks(path: Path, rows_per_chunk: int) -> Iterator[list[Row]]:
    chunk: list[Row] = []
    for row in iter_rows(path, rows_per_chunk):
        chunk.append((row["id"], row["source"], row["messages"], row["tools"], row["mode"]))
        if len(chunk) == rows_per_chunk:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def run(config: TokenizeConfig) -> TokenizeSummary:
    config.check()  # paths, the input's artifact kind, settings: before any work
    if config.workers > 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # a process per core already; fork-safe
    tokenizer = load_tokenizer(config.tokenizer, config.trust_remote_code)
    renderer = ChatRenderer.for_tokenizer(tokenizer)
    vocab_size = target_vocab_size(config.tokenizer, tokenizer)
    lineage = {
        "conversations_fingerprint": fingerprint_artifact(config.conversations),
        "tokenizer_fingerprint": fingerprint_tokenizer_dir(config.tokenizer),
        "chat_template_fingerprint": fingerprint_text(tokenizer.chat_template),
        **remote_code_record(config.tokenizer, config.trust_remote_code),
    }
    summary = TokenizeSummary()
    _worker.update(renderer=renderer, max_length=config.max_length)
    pool = multiprocessing.get_context("fork").Pool(config.workers) if config.workers > 1 else None
    try:
        # the output is published last, after the rejects file (a fault there leaves none)
        with parquet_stream(config.output, SCHEMA) as out, RejectsFile(config.rejects) as rejects:
            chunks = _chunks(config.conversations, config.chunk_rows)
            _write(
                pool.imap(_encode_chunk, chunks) if pool else map(_encode_chunk, chunks),
                out,
                rejects,
                summary,
            )
            summary.rejected = dict(rejects.reasons)
            out.header = make_header(
                "tokenized",
                lineage,
                vocab_size=vocab_size,
                max_length=config.max_length,
                truncation=TRUNCATION,
                num_tokens=summary.tokens,
                num_loss_tokens=summary.loss_tokens,
                num_truncated=summary.truncated,
                num_rejected=rejects.count,
                num_events=summary.events,
                loss_tokens_by_kind=summary.loss_tokens_by_kind,
                assistant_closing=renderer.closing,
                # Whose answers these are (the conversations' generator: "original" or the
                # regeneration's fingerprint), carried on to the dataset and the draft's card.
                answers={"generator": read_header(config.conversations).lineage.get("generator")},
            )
    finally:
        if pool is not None:
            pool.terminate()
    return summary


def _write(
    results: Iterator[list[Encoded]], out: Any, rejects: RejectsFile, summary: TokenizeSummary
) -> None:
    for chunk in results:
        kept = [e for e in chunk if e.error is None]
        for e in chunk:
            if e.error is not None:
                rejects.add(e.source, e.error, e.messages)
        if not kept:
            continue
        lengths = np.array([len(e.input_ids) for e in kept], dtype=np.int32)
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        # One flat array per column: no per-row conversion in the (busy) writing process.
        out.write(
            pa.table(
                {
                    "id": [e.sample_id for e in kept],
                    "input_ids": pa.ListArray.from_arrays(
                        offsets, pa.array(np.concatenate([e.input_ids for e in kept]))
                    ),
                    "loss_mask": pa.ListArray.from_arrays(
                        offsets, pa.array(np.concatenate([e.loss_mask for e in kept]))
                    ),
                    "num_tokens": lengths,
                    "num_loss_tokens": np.array(
                        [int(e.loss_mask.sum()) for e in kept], dtype=np.int32
                    ),
                },
                schema=SCHEMA,
            )
        )
        summary.written += len(kept)
        summary.tokens += sum(len(e.input_ids) for e in kept)
        summary.loss_tokens += sum(int(e.loss_mask.sum()) for e in kept)
        summary.truncated += sum(e.truncated for e in kept)
        summary.events += sum(e.event for e in kept)
        for e in kept:
            for kind, count in (e.kinds or {"answer": int(e.loss_mask.sum())}).items():
                summary.loss_tokens_by_kind[kind] += count
