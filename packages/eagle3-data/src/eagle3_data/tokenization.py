"""tokenize: conversations → token ids and assistant-only loss masks, in parallel processes.

Truncation policy: a sample longer than ``max_length`` keeps its first ``max_length`` tokens
(the prefix, so the prompt survives); a sample left without any trained token is rejected.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_data.config import TokenizeConfig
from eagle3_data.loss_mask import ChatRenderer, MaskError, token_mask
from eagle3_data.rejects import RejectsFile
from eagle3_schemas.header import make_header, parquet_stream, read_header
from eagle3_schemas.lineage import fingerprint_artifact, fingerprint_text, fingerprint_tokenizer_dir

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


@dataclass
class TokenizeSummary:
    written: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    truncated: int = 0
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


def load_tokenizer(directory: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def target_vocab_size(directory: Path, tokenizer: Any) -> int:
    """The target's vocabulary (embedding rows): config.json's when the directory has one."""
    config = directory / "config.json"
    size = json.loads(config.read_text())["vocab_size"] if config.is_file() else len(tokenizer)
    if len(tokenizer) > size:
        raise ValueError(
            f"{directory}: tokenizer has {len(tokenizer)} tokens but config.json vocab_size is {size}"
        )
    return int(size)


def encode(
    renderer: ChatRenderer,
    sample_id: str,
    source: str,
    messages: list[dict[str, str]],
    max_length: int,
) -> Encoded:
    text = renderer.render(messages)
    try:
        spans = renderer.trained_spans(messages, text)
    except MaskError as e:
        return Encoded(sample_id, source, error=str(e), messages=messages)
    enc = renderer.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int32)
    mask = token_mask(np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2), spans)
    truncated = len(ids) > max_length
    ids, mask = ids[:max_length], mask[:max_length]
    if not mask.any():
        reason = (
            "no_loss_tokens: every assistant token lies beyond max_length"
            if truncated
            else "no_loss_tokens: no assistant token in the rendered sample"
        )
        return Encoded(sample_id, source, error=reason, messages=messages)
    return Encoded(sample_id, source, ids, mask, truncated)


# ---- worker processes --------------------------------------------------------------------

_worker: dict[str, Any] = {}


def _init_worker(tokenizer_dir: str, max_length: int) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _worker["renderer"] = ChatRenderer.for_tokenizer(load_tokenizer(Path(tokenizer_dir)))
    _worker["max_length"] = max_length


def _encode_chunk(rows: list[tuple[str, str, list[dict[str, str]]]]) -> list[Encoded]:
    return [encode(_worker["renderer"], i, s, m, _worker["max_length"]) for i, s, m in rows]


def _chunks(
    path: Path, rows_per_chunk: int
) -> Iterator[list[tuple[str, str, list[dict[str, str]]]]]:
    for batch in pq.ParquetFile(path).iter_batches(
        batch_size=rows_per_chunk, columns=["id", "source", "messages"]
    ):
        d = batch.to_pydict()
        yield list(zip(d["id"], d["source"], d["messages"], strict=True))


def run(config: TokenizeConfig) -> TokenizeSummary:
    config.check()
    header = read_header(config.conversations)
    if header.artifact != "conversations":
        raise ValueError(
            f"{config.conversations}: is a {header.artifact!r} artifact, expected 'conversations'"
        )
    tokenizer = load_tokenizer(config.tokenizer)
    renderer = ChatRenderer.for_tokenizer(tokenizer)
    vocab_size = target_vocab_size(config.tokenizer, tokenizer)
    summary = TokenizeSummary()
    chunks = _chunks(config.conversations, config.chunk_rows)
    with RejectsFile(config.rejects) as rejects, parquet_stream(config.output, SCHEMA) as out:
        if config.workers == 1:
            _init_worker(str(config.tokenizer), config.max_length)
            results: Iterator[list[Encoded]] = map(_encode_chunk, chunks)
            _write(results, out, rejects, summary)
        else:
            ctx = multiprocessing.get_context(
                "spawn"
            )  # fork after the Rust tokenizer starts threads is unsafe
            with ctx.Pool(
                config.workers, _init_worker, (str(config.tokenizer), config.max_length)
            ) as pool:
                _write(pool.imap(_encode_chunk, chunks), out, rejects, summary)
        summary.rejected = dict(rejects.reasons)
        lineage = {
            "conversations_fingerprint": fingerprint_artifact(config.conversations),
            "tokenizer_fingerprint": fingerprint_tokenizer_dir(config.tokenizer),
            "chat_template_fingerprint": fingerprint_text(tokenizer.chat_template),
        }
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
            assistant_closing=renderer.closing,
        )
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
        out.write(
            pa.table(
                {
                    "id": [e.sample_id for e in kept],
                    "input_ids": [e.input_ids for e in kept],
                    "loss_mask": [e.loss_mask for e in kept],
                    "num_tokens": [len(e.input_ids) for e in kept],
                    "num_loss_tokens": [int(e.loss_mask.sum()) for e in kept],
                },
                schema=SCHEMA,
            )
        )
        summary.written += len(kept)
        summary.tokens += sum(len(e.input_ids) for e in kept)
        summary.loss_tokens += sum(int(e.loss_mask.sum()) for e in kept)
        summary.truncated += sum(e.truncated for e in kept)
