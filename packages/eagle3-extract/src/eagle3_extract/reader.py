"""Read samples back from a hidden-state dataset (for verify, merge and tests)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from eagle3_extract.storage import decode
from eagle3_schemas.io.safetensors_format import SafetensorsFile, read_safetensors
from eagle3_schemas.layouts.hidden_states import resolve_shard_path

TORCH_VIEWS = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
}


@dataclass(frozen=True)
class StoredSample:
    sample_id: str
    input_ids: np.ndarray
    loss_mask: np.ndarray
    states: torch.Tensor  # float32 [T, n_aux + 1, H]: aux ids, then id N


def _tensor(st: SafetensorsFile, name: str, start: int, stop: int) -> torch.Tensor:
    info = st.tensors[name]
    array = np.array(st.array(name)[start:stop])  # a copy: the mapped file is read-only
    tensor = torch.from_numpy(array)
    return tensor.view(TORCH_VIEWS[info.dtype]) if info.dtype in TORCH_VIEWS else tensor


class DatasetReader:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.manifest = pq.read_table(root / "manifest.parquet").to_pydict()
        self.row_of = {sid: i for i, sid in enumerate(self.manifest["sample_id"])}
        self._open: dict[str, SafetensorsFile] = {}

    def __len__(self) -> int:
        return len(self.manifest["sample_id"])

    def shard(self, rel: str) -> SafetensorsFile:
        if rel not in self._open:
            self._open[rel] = read_safetensors(resolve_shard_path(self.root, rel))
        return self._open[rel]

    def tokens(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        st = self.shard(self.manifest["shard"][row])
        a = self.manifest["row_start"][row]
        b = a + self.manifest["num_tokens"][row]
        return st.array("input_ids")[a:b], st.array("loss_mask")[a:b]

    def sample(self, row: int) -> StoredSample:
        st = self.shard(self.manifest["shard"][row])
        a = self.manifest["row_start"][row]
        b = a + self.manifest["num_tokens"][row]
        scaled = "aux_hidden_states_scale" in st.tensors
        aux = decode(
            _tensor(st, "aux_hidden_states", a, b),
            _tensor(st, "aux_hidden_states_scale", a, b) if scaled else None,
        )
        last = decode(
            _tensor(st, "last_hidden_state", a, b),
            _tensor(st, "last_hidden_state_scale", a, b) if scaled else None,
        )
        ids, mask = self.tokens(row)
        return StoredSample(
            self.manifest["sample_id"][row],
            ids.copy(),
            mask.copy(),
            torch.cat([aux, last.unsqueeze(1)], dim=1),
        )
