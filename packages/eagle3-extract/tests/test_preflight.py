"""Preflight: fails in seconds, before anything is written, naming what is wrong."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from eagle3_extract import preflight
from eagle3_extract.cli import main


def _argv(command: str, model: Path, tokenized: Path, out: Path, *extra: str) -> list[str]:
    return [
        command,
        "--model",
        str(model),
        "--tokenized",
        str(tokenized),
        "--out",
        str(out),
        *extra,
    ]


def test_preflight_passes_and_reports_each_check(
    llama_target: Path, tokenized: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_argv("preflight", llama_target, tokenized, tmp_path / "ds")) == 0
    printed = capsys.readouterr().out
    for check in ("tokenized input", "layer ids", "vocabulary", "disk", "transformers dry run"):
        assert f"] {check}:" in printed
    assert "hooks see the pre-norm residual stream" in printed
    assert not (tmp_path / "ds").exists() and not (tmp_path / "ds.partial").exists()


def test_bad_layer_ids_stop_the_run_before_anything_is_written(
    llama_target: Path, tokenized: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "ds"
    assert main(_argv("run", llama_target, tokenized, out, "--aux-layer-ids", "1,2,9")) == 1
    assert "[9] lie outside [0, 4]" in caplog.text
    assert not out.exists() and not out.with_name("ds.partial").exists()
    assert main(_argv("run", llama_target, tokenized, out, "--aux-layer-ids", "3,1")) == 1


def test_samples_tokenized_with_another_tokenizer_are_refused(
    llama_target: Path, tokenized: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text('{"model": "some other tokenizer"}')
    argv = _argv(
        "preflight", llama_target, tokenized, tmp_path / "ds", "--tokenizer", str(tokenizer)
    )
    assert main(argv) == 1
    assert "tokenized with another tokenizer" in capsys.readouterr().out


def test_disk_need_is_bytes_per_token_times_tokens(llama_target: Path, tmp_path: Path) -> None:
    from eagle3_extract.target import read_target

    target = read_target(llama_target)  # H = 32
    need = preflight.disk_need(target, 3, "bfloat16", num_tokens=1000, num_samples=10)
    head = 2 * (2 * 64 + 1) * 32
    assert need == 1000 * (4 * 32 * 2 + 5) + 10 * 8 + head
    free = shutil.disk_usage(tmp_path).free
    assert preflight.check_disk(tmp_path / "x", free * 2, 10)[0].level == "error"
    assert preflight.check_disk(tmp_path / "x", 1000, 10)[0].level == "ok"
