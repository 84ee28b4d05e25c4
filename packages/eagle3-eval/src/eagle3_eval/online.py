"""What the reference and vllm modes share: preflight of each draft, the prompt sets, the
follow-up turns, result assembly."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_eval.acceptance import SampleCounts, summarize
from eagle3_eval.config import OnlineConfig
from eagle3_eval.groups import TimedKey
from eagle3_eval.preflight import (
    DraftInfo,
    check_cuda_driver,
    check_lineage,
    check_served_by_vllm,
    check_target_shape,
    inspect_draft,
)
from eagle3_eval.prompts import (
    Prompt,
    PromptSet,
    Renderer,
    awaiting_answer,
    build_prompt_set,
    follow_up_prompts,
    renderer,
)
from eagle3_eval.report import Baseline, EvalResult
from eagle3_schemas.contract.lineage import fingerprint_model_dir


@dataclass
class MeasuredDraft:
    """One ``--draft``: its name (table row, folder under ``--out``) and what preflight read."""

    name: str
    info: DraftInfo
    notes: list[str] = field(default_factory=list)


@dataclass
class OnlineInputs:
    config: OnlineConfig
    drafts: list[MeasuredDraft]
    target_fingerprint: str
    prompts: PromptSet
    stop_token_ids: list[int]
    tokenizer: Any  # renders the follow-up turns once the target has answered
    notes: list[str] = field(default_factory=list)

    def lineage(self, draft: MeasuredDraft) -> dict[str, str]:
        return {
            "draft_fingerprint": draft.info.fingerprint,
            "target_fingerprint": self.target_fingerprint,
            "prompts_fingerprint": self.prompts.fingerprint,
        }

    def render(self) -> Renderer:
        return renderer(self.tokenizer, self.config.chat_template_kwargs)

    def follow_ups(
        self, asked: list[Prompt], answers: dict[str, list[int]]
    ) -> tuple[list[Prompt], list[str]]:
        """The next turns' prompts, given the target's greedy answers to turns of ``asked``,
        and which of them a further turn awaits (their answers are needed next)."""
        new = follow_up_prompts(self.prompts, asked, answers, self.tokenizer, self.render())
        return new, awaiting_answer(self.prompts, new)

    def all_turns(self, answer: Callable[[list[Prompt]], dict[str, list[int]]]) -> list[Prompt]:
        """Every prompt, later turns included: ``answer`` gives the target's greedy answers
        to the prompts a later turn follows, round by round (MT-Bench: one round)."""
        prompts = list(self.prompts.prompts)
        pending = awaiting_answer(self.prompts, prompts)
        while pending:
            answers = answer([p for p in prompts if p.sample_id in pending])
            new, pending = self.follow_ups(prompts, answers)
            prompts += new
        return prompts

    def prompt_tags(self, prompts: list[Prompt]) -> dict[str, dict[str, Any]]:
        return {
            p.sample_id: {
                "source": p.source,
                "prompt_set": p.prompt_set,
                "category": p.category,
                "turn": p.turn,
                "kind": p.kind,
            }
            for p in prompts
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


def prepare(config: OnlineConfig, served_by_vllm: bool = False) -> OnlineInputs:
    """Preflight (draft format + lineage, target shape; with ``served_by_vllm``, the tensors
    vLLM loads) and the held-out prompt set."""
    from transformers import AutoTokenizer

    driver_notes = check_cuda_driver()
    target_config_path = config.target / "config.json"
    if not target_config_path.is_file():
        raise FileNotFoundError(f"{config.target}: no config.json; expected a model directory")
    target_config = json.loads(target_config_path.read_text(encoding="utf-8"))
    target_fp = fingerprint_model_dir(config.target)
    drafts = []
    for source in config.drafts:
        info = inspect_draft(source.path, strict=not config.ignore_lineage)
        if served_by_vllm:
            check_served_by_vllm(info)
        check_target_shape(info.spec, target_config, f"target {config.target}")
        notes = list(info.notes) + check_lineage(
            info,
            {"target_fingerprint": target_fp},
            f"target {config.target}",
            config.ignore_lineage,
        )
        drafts.append(MeasuredDraft(source.name, info, notes))
    tokenizer = AutoTokenizer.from_pretrained(
        config.target, local_files_only=True, trust_remote_code=config.trust_remote_code
    )
    prompts = build_prompt_set(config.prompts, tokenizer, config.chat_template_kwargs)
    return OnlineInputs(
        config,
        drafts,
        target_fp,
        prompts,
        stop_token_ids(config.target, tokenizer),
        tokenizer,
        driver_notes,
    )


def assemble(
    inputs: OnlineInputs,
    draft: MeasuredDraft,
    mode: str,
    temperature: float,
    samples: list[SampleCounts],
    timing: tuple[float, dict[TimedKey, float]],
    baseline: Baseline | None,
    engine: dict[str, Any],
    extra: dict[str, Any],
    tags: dict[str, dict[str, Any]],
) -> EvalResult:
    """One draft's report at one temperature. ``timing``: generation seconds in all and per
    timed unit (set, category, kind); ``tags``: each sample's source, set, category, turn and
    kind."""
    config = inputs.config
    for s in samples:
        s.extra.update(tags[s.sample_id])
    summary = summarize(samples, config.k)
    seconds, group_seconds = timing
    return EvalResult(
        mode=mode,
        summary=summary,
        samples=samples,
        temperature=temperature,
        engine=engine,
        lineage=inputs.lineage(draft),
        tokens_per_second=summary.num_generated_tokens / seconds if seconds > 0 else None,
        baseline=baseline,
        group_seconds=group_seconds,
        extra={
            "inputs": {"target": str(config.target), "draft": str(draft.info.path)},
            "draft_name": draft.name,
            "prompts": inputs.prompts.description,
            "sampling": {
                "temperature": temperature,
                "seed": config.seed,
                "max_new_tokens": config.max_new_tokens,
                "stop_token_ids": inputs.stop_token_ids,
                "draft_proposal": config.draft_proposal if mode == "reference" else "greedy",
                "samples_per_prompt": config.draws(temperature) if mode == "reference" else 1,
                "chat_template_kwargs": config.chat_template_kwargs,
                # MT-Bench's later turns follow the target's own greedy answer to the turn before.
                "follow_up_turns_after": "the target's greedy answer",
            },
            "trust_remote_code": config.trust_remote_code,
            "notes": inputs.notes + draft.notes,
            **extra,
        },
    )
