"""verify passes a sound dataset and catches the classic silent corruptions.

The corrupt datasets are made the way real bugs make them: a backend capturing one layer later
than it claims (labels say [1, 2, 3], tensors are [2, 3, 4]); a backend pairing each token with
the states of the position before it, checksums written over the shifted rows; a backend using
transformers' ``output_hidden_states`` whose entry N is after the final norm; another target;
other tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from eagle3_extract.backends.hf import HFBackend
from eagle3_extract.cli import main
from eagle3_extract.config import ExtractConfig
from eagle3_extract.run import run
from eagle3_extract.samples import Sample
from eagle3_extract.verify import verify
from eagle3_schemas import read_header, validate
from eagle3_schemas.contract.header import make_header, write_json_header, write_parquet
from eagle3_schemas.io.safetensors_format import read_safetensors

from support.edits import map_hidden_state_rows


class OutputHiddenStatesBackend(HFBackend):
    """The common mistake: take transformers' ``output_hidden_states[k]`` as layer id k."""

    @torch.inference_mode()
    def forward_states(self, batch: Sequence[Sample]) -> list[torch.Tensor]:
        out = []
        for sample in batch:
            ids = torch.from_numpy(sample.input_ids.astype(np.int64))[None]
            hidden = self.model(input_ids=ids, output_hidden_states=True).hidden_states
            out.append(torch.stack([hidden[k][0] for k in self.layer_ids], dim=1).float())
        return out


def _extract(model: Path, tokenized: Path, out: Path, **kwargs) -> Path:
    backend = kwargs.pop("backend", None)
    run(ExtractConfig(model=model, tokenized=tokenized, out=out, **kwargs), hf_backend=backend)
    return out


def _relabel(dataset: Path, aux_layer_ids: list[int]) -> None:
    """Rewrite the header as a backend that mislabels its layers would have written it."""
    header = read_header(dataset)
    lineage = {**header.lineage, "aux_layer_ids": aux_layer_ids}
    fields = {**header.fields, "aux_layer_ids": aux_layer_ids}
    write_json_header(dataset / "dataset.json", make_header("hidden_states", lineage, **fields))


def _shift_aux_rows_one_late(dataset: Path) -> None:
    """Inside each sample, row t of aux_hidden_states takes the states of position t-1 (row 0
    keeps its own), then every manifest checksum is recomputed over the shifted bytes.

    This is what a backend that pairs tokens with states one position late writes: shapes,
    dtypes, token ids, masks and checksums are all consistent, so only recomputing the states
    can tell (the seed's failure, which cost acceptance 2.66 -> 2.03 in vLLM).
    """
    map_hidden_state_rows(
        dataset, "aux_hidden_states", lambda rows: np.concatenate([rows[:1], rows[:-1]])
    )


def test_sound_dataset_passes_with_per_layer_errors(
    llama_target: Path, tokenized: Path, tmp_path: Path
) -> None:
    ds = _extract(llama_target, tokenized, tmp_path / "ds")
    report_path = tmp_path / "report.json"
    argv = ["verify", str(ds), "--model", str(llama_target), "--tokenized", str(tokenized)]
    assert main([*argv, "--samples", "4", "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["ok"] and len(report["samples_recomputed"]) == 4
    assert [x["layer_id"] for x in report["layers"]] == [1, 2, 3, 4]
    for layer in report["layers"]:
        assert layer["max_rel"] <= 2**-8 + 1e-6  # bf16 rounding only: the compute is identical


def test_layer_ids_shifted_by_one_fail(llama_target: Path, tokenized: Path, tmp_path: Path) -> None:
    ds = _extract(llama_target, tokenized, tmp_path / "ds", aux_layer_ids=(2, 3, 4))
    _relabel(ds, [1, 2, 3])
    assert validate(ds) == []  # structurally perfect: only recomputation can tell
    report = verify(ds, llama_target, tokenized, num_samples=3)
    assert not report.ok
    by_id = {x.layer_id: x for x in report.layers}
    assert [i for i, x in by_id.items() if not x.ok] == [1, 2, 3]
    assert by_id[4].ok
    assert min(by_id[i].max_rel for i in (1, 2, 3)) > 10 * by_id[1].tolerance


def test_aux_states_one_position_late_with_matching_checksums_fail(
    llama_target: Path, tokenized: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ds = _extract(llama_target, tokenized, tmp_path / "ds")
    before = verify(ds, llama_target, tokenized, num_samples=3)
    assert before.ok, before.render()
    _shift_aux_rows_one_late(ds)
    assert validate(ds) == []  # checksums recomputed: the schema's deep checks all pass

    report = verify(ds, llama_target, tokenized, num_samples=3)
    assert report.problems == []  # lineage, token ids and masks are untouched
    by_id = {x.layer_id: x for x in report.layers}
    assert [i for i, x in by_id.items() if not x.ok] == [1, 2, 3], report.render()
    assert by_id[4].ok  # last_hidden_state was left in place
    # Off by O(1) of a row's scale, against a tolerance of bf16 rounding + 1e-4.
    assert min(by_id[i].max_rel for i in (1, 2, 3)) > 10 * by_id[1].tolerance
    assert report.render().startswith(f"verify {ds}: FAIL")

    argv = ["verify", str(ds), "--model", str(llama_target), "--tokenized", str(tokenized)]
    assert main([*argv, "--samples", "3"]) == 1
    printed = capsys.readouterr().out
    assert f"verify {ds}: FAIL" in printed
    failing_rows = [line.split()[0] for line in printed.splitlines() if line.endswith("  NO")]
    assert failing_rows == ["1", "2", "3"], printed


def test_post_norm_last_hidden_state_fails(
    llama_target: Path, tokenized: Path, tmp_path: Path
) -> None:
    naive = OutputHiddenStatesBackend(llama_target, [1, 2, 3, 4])
    ds = _extract(llama_target, tokenized, tmp_path / "ds", backend=naive)
    assert validate(ds) == []
    report = verify(ds, llama_target, tokenized, num_samples=3)
    assert not report.ok
    failing = [x.layer_id for x in report.layers if not x.ok]
    assert failing == [4], report.render()  # aux entries k < N of output_hidden_states are fine
    assert "last (pre-norm)" in report.render() and "FAIL" in report.render()
    argv = ["verify", str(ds), "--model", str(llama_target), "--samples", "2"]
    assert main(argv) == 1


def test_other_target_and_other_tokens_fail(
    target_factory: Callable[..., Path], llama_target: Path, tokenized: Path, tmp_path: Path
) -> None:
    ds = _extract(llama_target, tokenized, tmp_path / "ds")
    other = target_factory("llama", seed=5)
    report = verify(ds, other, tokenized)
    assert any("lineage target_fingerprint" in p for p in report.problems)

    # The same sample ids tokenized differently (as if re-tokenized after extraction).
    table = pq.read_table(tokenized)
    ids = table.column("input_ids").to_pylist()
    ids[1] = [(t + 1) % 32 for t in ids[1]]
    column = pa.array(ids, type=pa.list_(pa.int32()))
    changed = table.set_column(table.schema.get_field_index("input_ids"), "input_ids", column)
    retokenized = tmp_path / "retokenized.parquet"
    write_parquet(retokenized, changed, read_header(tokenized))
    report = verify(ds, llama_target, retokenized)
    assert not report.ok
    assert any("lineage tokenized_fingerprint" in p for p in report.problems)
    assert any("sample 'sample-1': stored input_ids differ" in p for p in report.problems)


def test_verify_refuses_a_dataset_that_does_not_validate(
    llama_target: Path, tokenized: Path, tmp_path: Path
) -> None:
    ds = _extract(llama_target, tokenized, tmp_path / "ds")
    shard = next((ds / "shards").glob("*.safetensors"))
    offset = read_safetensors(shard).tensors["last_hidden_state"].start + 6
    data = bytearray(shard.read_bytes())
    data[offset] ^= 0x01  # one flipped mantissa bit: still finite, still plausible
    shard.write_bytes(bytes(data))
    report = verify(ds, llama_target)
    assert not report.ok and any("checksum" in p for p in report.problems)


@pytest.mark.parametrize("storage", ["float32", "fp8_e4m3"])
def test_tolerance_follows_storage(
    storage: str, llama_target: Path, tokenized: Path, tmp_path: Path
) -> None:
    ds = _extract(llama_target, tokenized, tmp_path / "ds", storage_dtype=storage)
    report = verify(ds, llama_target, tokenized, num_samples=8)
    assert report.ok, report.render()
    worst = max(x.max_rel for x in report.layers)
    if storage == "float32":
        assert worst < 1e-5
    else:
        assert 2**-9 < worst <= 2**-4  # fp8 rounding is visible, and bounded
