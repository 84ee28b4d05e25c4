"""``--max-samples N --sample-seed S`` draws a reproducible random N; the capture shows a
progress bar (samples, tokens/s) on both backends."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow.parquet as pq
import pytest

from eagle3_extract.backends.vllm_backend import _generate
from eagle3_extract.cli import main
from eagle3_extract.progress import CaptureProgress
from eagle3_extract.samples import Sample, read_tokenized
from eagle3_schemas.layouts.conversations import select_rows

from support import fixtures

IDS = [f"sample-{i}" for i in range(200)]


def test_seeded_selection_is_reproducible_random_and_in_file_order() -> None:
    first = select_rows(IDS, 20)
    drawn = select_rows(IDS, 20, sample_seed=0)
    assert first == list(range(20))
    assert drawn == select_rows(IDS, 20, sample_seed=0)  # reproducible
    assert drawn != first and drawn == sorted(drawn) and len(set(drawn)) == 20
    assert max(drawn) >= 100  # reaches past the head of a corpus sorted by source
    assert drawn != select_rows(IDS, 20, sample_seed=1)
    # Chosen by id, not by row: the same samples whatever the file's row order.
    reordered = IDS[::-1]
    assert {reordered[r] for r in select_rows(reordered, 20, 0)} == {IDS[r] for r in drawn}
    assert select_rows(IDS, 500, sample_seed=3) == list(range(200))  # N >= rows: every row


def test_read_tokenized_keeps_each_drawn_sample_s_file_row(tmp_path: Path) -> None:
    path = fixtures.tokenized(tmp_path / "t.parquet", lengths=tuple(range(3, 23)))
    every = read_tokenized(path).samples
    drawn = read_tokenized(path, max_samples=5, sample_seed=7).samples
    assert [s.index for s in drawn] == select_rows([s.sample_id for s in every], 5, 7)
    for sample in drawn:  # the row's own tokens, and its row index (ranks split by it)
        assert sample.input_ids.tolist() == every[sample.index].input_ids.tolist()
        assert sample.sample_id == every[sample.index].sample_id


def test_run_records_the_selection_and_shows_progress(
    llama_target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenized = fixtures.tokenized(tmp_path / "t.parquet", lengths=tuple(range(3, 23)))
    out = tmp_path / "ds"
    argv = ["run", "--model", str(llama_target), "--tokenized", str(tokenized), "--out", str(out)]
    assert main([*argv, "--max-samples", "5", "--sample-seed", "7"]) == 0
    err = capsys.readouterr().err
    assert "extract: 100%" in err and "5/5" in err and "tokens/s" in err

    every = [s.sample_id for s in read_tokenized(tokenized).samples]
    expected = [every[r] for r in select_rows(every, 5, 7)]
    assert pq.read_table(out / "manifest.parquet").column("sample_id").to_pylist() == expected
    assert expected != every[:5]
    extraction = json.loads((out / "dataset.json").read_text())["extraction"]
    assert extraction["max_samples"] == 5 and extraction["sample_seed"] == 7
    assert extraction["selection"].startswith("5 rows at random")


class FakeLLM:
    """``LLM.generate`` driving ``use_tqdm`` as vLLM 0.32 does (entrypoints/common/offline.py:
    the callable wraps the prompts while rendering, then gives the request loop's bar)."""

    def __init__(self, on_finish: Callable[[], None], use_hook: bool = True) -> None:
        self.on_finish = on_finish
        self.use_hook = use_hook

    def generate(self, prompts: list[Any], params: list[Any], use_tqdm: Any) -> list[Any]:
        hook = use_tqdm if self.use_hook and callable(use_tqdm) else None
        rendered = list(hook(prompts, desc="Rendering prompts")) if hook else prompts
        bar = (
            hook(total=len(rendered), desc="Processed prompts", dynamic_ncols=True)
            if hook
            else None
        )
        for _ in reversed(rendered):  # requests finish in any order
            if bar is not None:
                speed = 1.0 / bar.format_dict["elapsed"]
                bar.postfix = f"est. speed input: {speed:.2f} toks/s"
                bar.update(1)
                if bar.n == len(rendered):
                    bar.refresh()
            self.on_finish()
        if bar is not None:
            bar.close()
        return [SimpleNamespace(prompt_token_ids=p) for p in rendered]


def _samples(lengths: Sequence[int]) -> list[Sample]:
    import numpy as np

    return [
        Sample(i, f"s{i}", np.arange(n, dtype=np.int32), np.ones(n, np.uint8))
        for i, n in enumerate(lengths)
    ]


@pytest.mark.parametrize("use_hook", [True, False])
def test_vllm_driver_feeds_the_bar_per_finished_request(use_hook: bool) -> None:
    samples = _samples([4, 6, 10, 3, 7])
    progress = CaptureProgress(len(samples), sum(s.num_tokens for s in samples))
    seen: list[int] = []
    llm = FakeLLM(lambda: seen.append(progress.samples), use_hook)
    for group in (samples[:3], samples[3:]):
        _generate(llm, [(s.input_ids.tolist(), None) for s in group], group, progress)
    progress.close()
    # With the hook, one step per finished request; an engine ignoring it, one per call.
    assert seen == ([1, 2, 3, 4, 5] if use_hook else [0, 0, 0, 3, 3])
    assert progress.samples == 5
    assert progress.tokens == pytest.approx(30)  # exact once every call has ended
