"""A transformers-only speculative decoding loop: the reference where vLLM is absent.

It reproduces vLLM's EAGLE-3 schedule for one request at a time:

1. prefill: the target runs the prompt x_0..x_{P-1} and samples x_P; the draft's first pass
   covers rows 0..P-1 (target state of row t with token x_{t+1}) into the draft KV cache;
2. the draft proposes k tokens: the first from its last row, each next one from a chain step
   fed its own output state and its previous token, one position further on (these chain
   rows are temporary: vLLM overwrites them once the target has verified);
3. the target verifies (last token, d_1..d_k) in one forward; the accepted prefix and the
   correction/bonus token are appended, the target cache is cropped to the verified tokens,
   and the draft's next first pass covers exactly the newly verified rows;
4. repeat until a stop token or ``max_new_tokens``.

Counting follows vLLM's scheduler: every verification step counts one draft of k tokens and
its whole accepted prefix, even when a stop token or the length limit truncates the output;
the proposal left unverified when the request ends is not counted.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from eagle3_eval.acceptance import SampleCounts
from eagle3_eval.draft import Eagle3Draft
from eagle3_eval.draft_layers import KV
from eagle3_eval.groups import timed_per_sample
from eagle3_eval.online import OnlineInputs, assemble
from eagle3_eval.prompts import Prompt
from eagle3_eval.rejection import sample, target_probs, verify_greedy, verify_sampled
from eagle3_eval.report import Baseline, EvalResult, versions
from eagle3_eval.target import DTYPES, Target, capture_aux, crop_cache, load_target


@dataclass(frozen=True)
class Request:
    sample_id: str
    prompt_token_ids: list[int]


@dataclass(frozen=True)
class DecodeSettings:
    max_new_tokens: int
    temperature: float
    seed: int
    stop_token_ids: tuple[int, ...]
    # "greedy": the draft proposes its argmax (vLLM's default); "sample": it samples from its
    # own distribution at the request's temperature and rejection sampling uses that q.
    draft_proposal: str = "greedy"


class DraftCache:
    """The draft's KV cache: one KV per layer, rows for positions 0..len-1."""

    def __init__(self) -> None:
        self.layers: list[KV] | None = None

    def __len__(self) -> int:
        return 0 if self.layers is None else len(self.layers[0])

    def extended(self, new: list[KV]) -> list[KV]:
        if self.layers is None:
            return new
        return [KV.cat([old, add]) for old, add in zip(self.layers, new, strict=True)]


class SpeculativeDecoder:
    """Target + draft, one request at a time; ``draft=None`` decodes with the target alone."""

    def __init__(self, target: Target, draft: Eagle3Draft | None, k: int) -> None:
        if draft is not None and k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        self.target, self.draft, self.k = target, draft, k
        self.aux_ids = draft.spec.aux_layer_ids if draft is not None else ()

    @torch.inference_mode()
    def generate(self, request: Request, settings: DecodeSettings) -> SampleCounts:
        started = time.perf_counter()
        generator = torch.Generator().manual_seed(settings.seed)
        counts = SampleCounts(request.sample_id, self.k if self.draft is not None else 0)
        if self.draft is None:
            output = self._plain(request.prompt_token_ids, settings, generator)
        else:
            output = self._speculative(request.prompt_token_ids, settings, generator, counts)
        counts.output_token_ids = output
        counts.num_generated_tokens = len(output)
        counts.num_prompt_tokens = len(request.prompt_token_ids)
        counts.seconds = time.perf_counter() - started
        return counts

    # ---- pieces --------------------------------------------------------------------------

    def _next_token(
        self, logits: Tensor, settings: DecodeSettings, generator: torch.Generator
    ) -> int:
        if settings.temperature == 0:
            return int(logits.argmax())
        return sample(target_probs(logits, settings.temperature), generator)

    def _target_forward(
        self, tokens: list[int], cache: object, aux: list[Tensor] | None
    ) -> tuple[Tensor, Tensor | None]:
        out = self.target.model(
            input_ids=torch.tensor([tokens]), past_key_values=cache, use_cache=True
        )
        states = aux[0][0] if aux else None
        return out.logits[0].float(), states

    def _append(self, output: list[int], new: list[int], settings: DecodeSettings) -> bool:
        """Append tokens one by one as vLLM does; True when the request is finished."""
        for token in new:
            output.append(token)
            if token in settings.stop_token_ids or len(output) >= settings.max_new_tokens:
                return True
        return False

    def _plain(
        self, prompt: list[int], settings: DecodeSettings, generator: torch.Generator
    ) -> list[int]:
        from transformers import DynamicCache

        cache = DynamicCache()
        logits, _ = self._target_forward(prompt, cache, None)
        output: list[int] = []
        token = self._next_token(logits[-1], settings, generator)
        while not self._append(output, [token], settings):
            logits, _ = self._target_forward([token], cache, None)
            token = self._next_token(logits[-1], settings, generator)
        return output

    def _speculative(
        self,
        prompt: list[int],
        settings: DecodeSettings,
        generator: torch.Generator,
        counts: SampleCounts,
    ) -> list[int]:
        from transformers import DynamicCache

        draft = self.draft
        assert draft is not None
        cache = DynamicCache()
        draft_cache = DraftCache()
        output: list[int] = []
        with capture_aux(self.target.model, self.aux_ids) as aux:
            logits, states = self._target_forward(prompt, cache, aux)
            assert states is not None
            token = self._next_token(logits[-1], settings, generator)
            # Rows the draft has not seen yet: target states of the fed tokens, paired with the
            # token that follows each (the last one is the token just sampled).
            pending_states, pending_tokens = states, [*prompt[1:], token]
            finished = self._append(output, [token], settings)
            while not finished:
                proposals, draft_probs = self._propose(
                    pending_states, pending_tokens, draft_cache, settings, generator
                )
                fed = len(draft_cache)  # = tokens the target has cached
                verify_logits, states = self._target_forward([token, *proposals], cache, aux)
                assert states is not None
                if settings.temperature == 0:
                    accepted, token = verify_greedy(verify_logits, torch.tensor(proposals))
                else:
                    accepted, token = verify_sampled(
                        verify_logits,
                        torch.tensor(proposals),
                        draft_probs,
                        settings.temperature,
                        generator,
                    )
                counts.observe(self.k, accepted)
                crop_cache(cache, fed + accepted + 1)
                pending_states = states[: accepted + 1]
                pending_tokens = [*proposals[:accepted], token]
                finished = self._append(output, [*proposals[:accepted], token], settings)
        return output

    def _propose(
        self,
        states: Tensor,
        tokens: list[int],
        draft_cache: DraftCache,
        settings: DecodeSettings,
        generator: torch.Generator,
    ) -> tuple[list[int], Tensor | None]:
        """First pass over the pending rows (kept in the cache), then k-1 chain steps."""
        draft = self.draft
        assert draft is not None
        start, n = len(draft_cache), len(tokens)
        positions = torch.arange(start, start + n)
        mask = torch.ones(n, start + n, dtype=torch.bool)
        mask[:, start:] = torch.tril(mask[:, start:])
        step = draft(
            draft.combine(states), torch.tensor(tokens), positions, draft_cache.layers, mask
        )
        draft_cache.layers = draft_cache.extended(step.kv)
        chain = draft_cache.layers
        logits, hidden = step.logits[-1:], step.chain_hidden[-1:]
        proposals: list[int] = []
        probs: list[Tensor] = []
        sample_draft = settings.draft_proposal == "sample" and settings.temperature > 0
        for i in range(self.k):
            if sample_draft:
                q_draft = target_probs(logits[0], settings.temperature)
                draft_id = sample(q_draft, generator)
                q = torch.zeros(draft.spec.target_vocab_size)
                q[draft.target_ids()] = q_draft
                probs.append(q)
            else:
                draft_id = int(logits[0].argmax())
            proposals.append(int(draft.to_target_ids(torch.tensor(draft_id))))
            if i == self.k - 1:
                break
            position = start + n + i
            mask = torch.ones(1, position + 1, dtype=torch.bool)
            step = draft(
                hidden, torch.tensor(proposals[-1:]), torch.tensor([position]), chain, mask
            )
            chain = [KV.cat([c, s]) for c, s in zip(chain, step.kv, strict=True)]
            logits, hidden = step.logits, step.chain_hidden
        return proposals, (torch.stack(probs) if probs else None)


def run_requests(
    decoder: SpeculativeDecoder, requests: list[Request], settings: DecodeSettings
) -> list[SampleCounts]:
    """Each request with its own seed (settings.seed + index), so runs are reproducible."""
    return [
        decoder.generate(request, dataclasses.replace(settings, seed=settings.seed + index))
        for index, request in enumerate(requests)
    ]


def run_reference(inputs: OnlineInputs) -> dict[str, list[EvalResult]]:
    """Per draft, every temperature, each prompt drawn config.draws(temperature) times; the
    target alone (unless disabled) the same way, once per temperature, as every draft's baseline. Later turns (MT-Bench) are asked after the target's own answer
    to the turn before: its greedy output, decoded here by the target alone, first."""
    config = inputs.config
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    target = load_target(config.target, config.dtype, config.trust_remote_code)
    device = torch.device(config.device)
    target.model.to(device)
    engine = {
        "name": "transformers",
        "versions": versions("eagle3-eval", "torch", "transformers"),
        "device": str(device),
        "dtype": config.dtype,
        "threads": torch.get_num_threads(),
        "batch_size": 1,
    }
    plain = SpeculativeDecoder(target, None, 0)
    stops = tuple(inputs.stop_token_ids)

    def settings(temperature: float) -> DecodeSettings:
        return DecodeSettings(
            config.max_new_tokens, temperature, config.seed, stops, config.draft_proposal
        )

    def greedy_answers(prompts: list[Prompt]) -> dict[str, list[int]]:
        with device:
            done = run_requests(plain, requests_of(prompts), settings(0.0))
        return {c.sample_id: list(c.output_token_ids or []) for c in done}

    prompts = inputs.all_turns(greedy_answers)
    requests, tags = requests_of(prompts), inputs.prompt_tags(prompts)
    baselines: dict[float, Baseline] = {}
    if config.baseline:
        for temperature in config.temperatures:
            drawn_requests, drawn_tags = drawn(requests, tags, config.draws(temperature))
            with device:
                alone = run_requests(plain, drawn_requests, settings(temperature))
            baselines[temperature] = Baseline(
                tokens_per_second=sum(s.num_generated_tokens for s in alone)
                / sum(s.seconds or 0.0 for s in alone),
                per_sample={
                    s.sample_id: (s.num_generated_tokens, s.seconds, s.output_token_ids)
                    for s in alone
                },
                group_seconds=timed_per_sample(tag(alone, drawn_tags)),
            )
    out: dict[str, list[EvalResult]] = {}
    for measured in inputs.drafts:
        draft = Eagle3Draft.load(measured.info.path, target.embed_tokens)
        speculative = SpeculativeDecoder(target, draft.to(device, DTYPES[config.dtype]), config.k)
        out[measured.name] = []
        for temperature in config.temperatures:
            drawn_requests, drawn_tags = drawn(requests, tags, config.draws(temperature))
            with device:  # the decoders' step tensors are made where the models are
                samples = run_requests(speculative, drawn_requests, settings(temperature))
            samples = tag(samples, drawn_tags)
            timing = (sum(s.seconds or 0.0 for s in samples), timed_per_sample(samples))
            out[measured.name].append(
                assemble(
                    inputs,
                    measured,
                    "reference",
                    temperature,
                    samples,
                    timing,
                    baselines.get(temperature),
                    engine,
                    {},
                    drawn_tags,
                )
            )
    return out


def drawn(
    requests: list[Request], tags: dict[str, dict[str, Any]], draws: int
) -> tuple[list[Request], dict[str, dict[str, Any]]]:
    """Each request ``draws`` times, draw after draw, with each draw's tags. The first draw keeps
    the ids (and, by run_requests' seed + index, the seeds) of a run without copies; draw j > 0
    of a request is ``ID#j``."""
    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws}")
    out = [
        Request(r.sample_id if j == 0 else f"{r.sample_id}#{j}", r.prompt_token_ids)
        for j in range(draws)
        for r in requests
    ]
    return out, {d.sample_id: tags[r.sample_id] for d, r in zip(out, requests * draws, strict=True)}


def requests_of(prompts: list[Prompt]) -> list[Request]:
    return [Request(p.sample_id, p.token_ids) for p in prompts]


def tag(samples: list[SampleCounts], tags: dict[str, dict[str, Any]]) -> list[SampleCounts]:
    """Each sample's set, category and turn, so it can be timed by group."""
    for s in samples:
        s.extra.update(tags[s.sample_id])
    return samples
