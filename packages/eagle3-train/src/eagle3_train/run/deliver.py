"""What a run delivers: validated exports of the draft (``OUTPUT/exports/step-N``, model card
included) and the published deliverable ``OUTPUT/draft``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from eagle3_schemas.contract.validate import validate
from eagle3_schemas.io.diskspace import disk_full, is_disk_full
from eagle3_train.components.checkpoint import TrainerState
from eagle3_train.data.inputs import RunInputs, checkpoint_lineage
from eagle3_train.export.sglang import SGLANG_DIR, write_sglang_export
from eagle3_train.export.write import draft_config, export_weights, write_checkpoint
from eagle3_train.model.arch import DraftArch


class Delivery:
    """Exports of the model being trained, and the publication of the chosen one."""

    def __init__(self, accelerator, model, inputs: RunInputs, arch: DraftArch) -> None:
        self.accelerator = accelerator
        self.model = model
        self.inputs = inputs
        self.arch = arch
        self.output_dir = Path(inputs.config.output_dir)

    def export(self, state: TrainerState, metrics: dict[str, Any]) -> Path | None:
        """Gather the weights (every rank takes part under ZeRO-3) and write a validated
        export (main process; None on the others)."""
        accelerator, inputs = self.accelerator, self.inputs
        full = accelerator.get_state_dict(self.model)
        if not accelerator.is_main_process:
            return None
        cfg = inputs.config
        out = self.output_dir / "exports" / f"step-{state.step:08d}"
        if out.exists():
            return out
        unwrapped = accelerator.unwrap_model(self.model)
        target_arch = (inputs.target_config or {}).get("architectures") or [
            inputs.dataset.header["target"]["architecture"]
        ]
        config_json = draft_config(
            self.arch,
            inputs.aux_layer_ids,
            cfg.target.name_or_path or cfg.target.path,
            list(target_arch),
            cfg.export.speculative_tokens,
        )
        weights = export_weights(
            full,
            inputs.vocab.d2t,
            inputs.vocab.t2d,
            cfg.export.dtype,
            unwrapped.embed_tokens if cfg.export.include_embeddings else None,
        )
        lineage = checkpoint_lineage(inputs)
        training = {
            "steps": state.step,
            "tokens": state.tokens,
            "epoch": state.epoch,
            "metrics": metrics,
        }
        try:
            write_checkpoint(
                out, config_json, weights, lineage, inputs.aux_layer_ids, training, cfg
            )
        except Exception as e:  # (its temporary directory is gone: atomic_directory)
            if not is_disk_full(e):
                raise
            needed = sum(t.numel() * t.element_size() for t in weights.values())
            raise disk_full(out, f"export {out.name}", needed, e) from e
        problems = validate(out)
        if problems:
            raise RuntimeError(
                f"{out}: the export does not validate:\n  " + "\n  ".join(map(str, problems))
            )
        return out

    def publish(self, export: Path) -> Path:
        """Publish ``export`` as ``export.format`` says: ``OUTPUT/draft`` (speculators),
        ``OUTPUT/draft-sglang`` (SGLang), or both; each a temp copy, then swapped in. Returns
        the first."""
        fmt = self.inputs.config.export.format
        published = []
        if fmt in ("speculators", "both"):
            published.append(self._swap_in(export, "draft", shutil.copytree))
        if fmt in ("sglang", "both"):
            cfg = self.inputs.config
            served = f"{cfg.export.card.repo_id}-sglang" if cfg.export.card.repo_id else None

            def write(src: Path, dst: Path) -> None:
                write_sglang_export(src, dst, cfg, served or str(self.output_dir / SGLANG_DIR))

            published.append(self._swap_in(export, SGLANG_DIR, write))
        return published[0]

    def _swap_in(self, export: Path, name: str, copy) -> Path:
        output_dir = self.output_dir
        final = output_dir / name
        tmp = output_dir / f".tmp-{name}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            copy(export, tmp)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if not is_disk_full(e):
                raise
            needed = sum(f.stat().st_size for f in export.rglob("*") if f.is_file())
            raise disk_full(final, "the published draft", needed, e) from e
        if final.exists():
            old = output_dir / f".old-{name}"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        return final
