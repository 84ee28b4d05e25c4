"""What the vLLM backend relies on in the installed vLLM, checked before an engine starts.

The hidden-states connector's methods and fields, the in-process engine's stepper, and the
target model class's capture of auxiliary layers: each read by introspection and reported as a
preflight ``Finding``, so a vLLM upgrade that changes one fails by name in seconds instead of
corrupting data or timing out. ``vllm_backend`` runs them before its dry run.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from eagle3_extract.preflight import Finding


def introspect() -> list[Finding]:
    """Check the installed vLLM exposes what the connector and driver rely on."""
    try:
        import vllm
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.v1 import (
            example_hidden_states_connector as ex,
        )
    except ImportError as e:
        return [Finding("error", "vllm", f"cannot import vLLM's hidden-states connector: {e}")]
    findings = [Finding("ok", "vllm", f"vllm {vllm.__version__} at {Path(vllm.__file__).parent}")]
    expected = {
        "request_finished": ["self", "request", "block_ids"],
        "build_connector_meta": ["self", "scheduler_output"],
        "get_finished": ["self", "finished_req_ids"],
        "register_kv_caches": ["self", "kv_caches"],
        "get_finished_count": ["self"],
    }
    cls = ex.ExampleHiddenStatesConnector
    problems = []  # of the connector's API
    for name, params in expected.items():
        method = getattr(cls, name, None)
        found = list(inspect.signature(method).parameters) if method else None
        if found != params:
            problems.append(f"{cls.__name__}.{name}{found}, expected {params}")
    pending_fields = list(getattr(ex.PendingSave, "__dataclass_fields__", {}))
    if pending_fields != ["req_id", "filename", "token_ids", "block_ids"]:
        problems.append(f"PendingSave fields {pending_fields}")
    extract_params = list(inspect.signature(ex.extract_from_kv_cache).parameters)
    if extract_params != ["kv_cache", "slot_mapping", "num_tokens"]:
        problems.append(f"extract_from_kv_cache{extract_params}")
    init_source = inspect.getsource(cls.__init__) + inspect.getsource(cls.register_kv_caches)
    for attribute in ("self._kv_cache", "self._block_size", "self._is_tp_rank_zero"):
        if attribute not in init_source:
            problems.append(f"{cls.__name__} no longer sets {attribute}")
    findings += [Finding("error", "vllm connector API", p) for p in problems]
    findings += _stepper_findings()
    if "kv_connector_module_path" not in getattr(KVTransferConfig, "__dataclass_fields__", {}):
        findings.append(
            Finding("error", "vllm", "KVTransferConfig has no kv_connector_module_path")
        )
    if not any(f.level == "error" for f in findings):
        findings.append(
            Finding("ok", "vllm connector API", "hidden-states connector interface as expected")
        )
    return findings


def _stepper_findings() -> list[Finding]:
    """What ``_engine_stepper`` relies on: an in-process core is an ``InprocClient`` held as
    ``LLMEngine.engine_core``, and ``LLMEngine.step()`` takes no argument. Were either renamed,
    an in-process run would time out waiting for its first shard instead of failing here."""
    from vllm.v1.engine import core_client, llm_engine

    problems = []
    if not isinstance(getattr(core_client, "InprocClient", None), type):
        problems.append("vllm.v1.engine.core_client has no class InprocClient")
    engine = llm_engine.LLMEngine
    step = getattr(engine, "step", None)
    params = list(inspect.signature(step).parameters) if step else None
    if params != ["self"]:
        problems.append(f"LLMEngine.step{params}, expected ['self']")
    if "self.engine_core" not in inspect.getsource(engine.__init__):
        problems.append("LLMEngine.__init__ no longer sets self.engine_core")
    return [Finding("error", "vllm engine API", p) for p in problems]


# vLLM's DeepseekV2/V3 model (DeepSeek-V3, Kimi-K2.x) adds ``hidden_states + residual`` for an
# aux id before its layer runs; before layer 0 the residual is None, so id 0 kills the engine.
ID0_UNSAFE_PATTERN = "aux_hidden_state = hidden_states + residual"


def _model_sources(module: ModuleType) -> list[str]:
    """Source of a vLLM model module and of the model modules it imports (a multimodal wrapper
    such as Kimi-K2.5's runs the language model of another module)."""
    source = inspect.getsource(module)
    sources = [source]
    names = set(re.findall(r"from (vllm\.model_executor\.models\.\w+) import", source))
    for name in sorted(names):
        try:
            sources.append(inspect.getsource(importlib.import_module(name)))
        except (ImportError, OSError):
            continue
    # Wrappers that build their language model by architecture name (Kimi-K2.5).
    from vllm.model_executor.models import ModelRegistry

    for arch in sorted(set(re.findall(r'architectures=\["(\w+)"\]', source))):
        inner = ModelRegistry._try_load_model_cls(arch)
        if inner is not None:
            sources.append(inspect.getsource(sys.modules[inner.__module__]))
    return sources


def model_findings(
    architecture: str, pipeline_parallel_size: int, layer_ids: Sequence[int] = ()
) -> list[Finding]:
    """The target's vLLM model class captures aux states (and across pipeline stages if asked)."""
    try:
        from vllm.model_executor.models import ModelRegistry

        model_cls = ModelRegistry._try_load_model_cls(architecture)
    except Exception as e:  # a private helper: report, never crash preflight on it
        return [Finding("warning", "vllm model", f"cannot resolve {architecture}: {e}")]
    if model_cls is None:
        return [Finding("error", "vllm model", f"vLLM has no model class for {architecture}")]
    problems = []
    if not getattr(model_cls, "supports_eagle3", False):
        problems.append(f"{model_cls.__name__} does not implement SupportsEagle3")
    module = sys.modules[model_cls.__module__]
    if 0 in layer_ids and any(ID0_UNSAFE_PATTERN in src for src in _model_sources(module)):
        problems.append(
            f"{model_cls.__name__} cannot capture layer id 0 (embedding output): vLLM adds "
            "the residual before layer 0, where it is None, and the engine dies; use ids >= 1"
        )
    if pipeline_parallel_size > 1:
        over_pp = any(
            getattr(obj, "supports_aux_hidden_states_over_pp", False)
            for obj in vars(module).values()
            if isinstance(obj, type) and obj.__module__ == module.__name__
        )
        if not over_pp:
            problems.append(
                f"{model_cls.__name__} does not pass aux hidden states between pipeline "
                "stages: with pipeline_parallel_size > 1 the states of earlier stages would be "
                "lost; use tensor parallelism"
            )
    return [Finding("error", "vllm model", p) for p in problems] or [
        Finding("ok", "vllm model", f"{model_cls.__name__} supports EAGLE-3 capture")
    ]
