"""What the reference and vllm modes share: preflight, the prompt set, result assembly."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_eval.acceptance import SampleCounts, summarize
from eagle3_eval.config import OnlineConfig
from eagle3_eval.preflight import (
    DraftInfo,
    check_cuda_driver,
    check_lineage,
    check_target_shape,
    inspect_draft,
)
from eagle3_eval.prompts import PromptSet, build_prompt_set
from eagle3_eval.report import Baseline, EvalResult
from eagle3_schemas.lineage import fingerprint_model_dir


@dataclass
class OnlineInputs:
    config: OnlineConfig
    draft: DraftInfo
    target_fingerprint: str
    prompts: PromptSet
    stop_token_ids: list[int]
    notes: list[str] = field(default_factory=list)

    @property
    def lineage(self) -> dict[str, str]:
        return {
            "draft_fingerprint": self.draft.fingerprint,
            "target_fingerprint": self.target_fingerprint,
            "prompts_fingerprint": self.prompts.fingerprint,
        }


def stop_token_ids(target: Path, tokenizer: Any) -> list[int]:
    """EOS ids of the tokenizer and of generation_config.json: where both engines stop."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation = target / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text(encoding="utf-8")).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(i) for i in eos)
    return sorted(ids)


def prepare(config: OnlineConfig) -> OnlineInputs:
    """Preflight (draft format + lineage, target shape) and the held-out prompt set."""
    from transformers import AutoTokenizer

    driver_notes = check_cuda_driver()
    draft = inspect_draft(config.draft, strict=not config.ignore_lineage)
    target_config_path = config.target / "config.json"
    if not target_config_path.is_file():
        raise FileNotFoundError(f"{config.target}: no config.json; expected a model directory")
    target_config = json.loads(target_config_path.read_text(encoding="utf-8"))
    check_target_shape(draft.spec, target_config, f"target {config.target}")
    target_fp = fingerprint_model_dir(config.target)
    notes = list(draft.notes) + driver_notes
    notes += check_lineage(
        draft, {"target_fingerprint": target_fp}, f"target {config.target}", config.ignore_lineage
    )
    tokenizer = AutoTokenizer.from_pretrained(
        config.target, local_files_only=True, trust_remote_code=config.trust_remote_code
    )
    prompts = build_prompt_set(config.prompts, tokenizer, config.chat_template_kwargs)
    return OnlineInputs(
        config, draft, target_fp, prompts, stop_token_ids(config.target, tokenizer), notes
    )


def assemble(
    inputs: OnlineInputs,
    mode: str,
    temperature: float,
    samples: list[SampleCounts],
    seconds: float,
    baseline: Baseline | None,
    engine: dict[str, Any],
    extra: dict[str, Any],
) -> EvalResult:
    config = inputs.config
    sources = {p.sample_id: p.source for p in inputs.prompts.prompts}
    for s in samples:
        s.extra.setdefault("source", sources.get(s.sample_id, ""))
    summary = summarize(samples, config.k)
    return EvalResult(
        mode=mode,
        summary=summary,
        samples=samples,
        temperature=temperature,
        engine=engine,
        lineage=inputs.lineage,
        tokens_per_second=summary.num_generated_tokens / seconds if seconds > 0 else None,
        baseline=baseline,
        extra={
            "inputs": {"target": str(config.target), "draft": str(config.draft)},
            "prompts": inputs.prompts.description,
            "sampling": {
                "temperature": temperature,
                "seed": config.seed,
                "max_new_tokens": config.max_new_tokens,
                "stop_token_ids": inputs.stop_token_ids,
                "draft_proposal": config.draft_proposal if mode == "reference" else "greedy",
                "chat_template_kwargs": config.chat_template_kwargs,
            },
            "trust_remote_code": config.trust_remote_code,
            "notes": inputs.notes,
            **extra,
        },
    )
