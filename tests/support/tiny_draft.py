"""Build the eval stage's test assets for the embedded tiny target, without eagle3-train.

The eval tests need a draft that is really trained on the tiny target (to show acceptance
clearly above an untrained one, in vLLM and in the reference loop alike), but must not
depend on the trainer, which is another stage. This script trains one itself, in minutes:

1. the tiny target's corpus (``support.tiny_corpus``), split by
   source file into train and held-out;
2. the target's aux hidden states (vLLM layer ids, pre-norm, via transformers hooks) over
   train conversations, and a draft vocabulary of the most frequent answer tokens;
3. a one-layer EAGLE-3 draft trained with a short test-time-training unroll: forward KL to the
   target's next-token distribution (restricted to the draft vocabulary) at every chain step,
   using ``eagle3_eval.draft.chain_logits`` (vLLM's pairing: row t = state of t + token t+1);
4. exported in the speculators format with eagle3.json lineage (a valid draft_checkpoint),
   plus an untrained draft of the same shape, a held-out hidden-state dataset (a valid
   hidden_states artifact) and the corpus JSONL for prompts.

Sharing the draft forward with the evaluator is deliberate: if that forward misread vLLM's
semantics, the draft would score well in the reference loop and badly in vLLM, and the vllm
test tier would say so.

    PYTHONPATH=tests uv run python -m support.tiny_draft               # the default cache folder, ~4 min
    PYTHONPATH=tests uv run python -m support.tiny_draft --print-dir   # where this target's assets live
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F

from eagle3_eval.draft import Eagle3Draft, chain_logits
from eagle3_eval.draft_spec import DraftSpec
from eagle3_eval.target import capture_aux, load_target
from eagle3_schemas.contract.header import (
    make_header,
    write_json_header,
    write_parquet,
    write_safetensors,
)
from eagle3_schemas.contract.lineage import (
    fingerprint_artifact,
    fingerprint_file,
    fingerprint_json,
    fingerprint_model_dir,
    fingerprint_tokenizer_dir,
    fingerprint_vocab_map,
)
from eagle3_schemas.contract.validate import validate
from eagle3_schemas.io.atomic import atomic_directory, write_json_atomic
from eagle3_schemas.layouts.conversations import conversation_id
from eagle3_schemas.layouts.hidden_states import SHARD_DIR, checksum_rows

from support import tiny_corpus
from support.drafts import random_draft, save_draft, speculators_config
from support.imports import followed_imports, module_sources

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "recipes" / "tiny" / "target"
AUX_LAYER_IDS = [2, 3, 5]  # low, middle, high of the 6-layer target (as recipes/tiny/train.yaml)
K_TRAIN = 3  # test-time-training unroll
MAX_TOKENS = 512
DEFAULTS = {
    "train_conversations": 600,
    "heldout_conversations": 48,
    "draft_vocab_size": 3072,
    "steps": 200,
    "max_minutes": 12.0,
    "lr": 2e-3,
    "seqs_per_step": 8,
    "seed": 0,
}


# The packages whose modules build and check the assets: their imports are followed.
FOLLOWED = ("eagle3_eval", "eagle3_schemas")


def _source_name(module: str, origin: Path) -> str:
    """A module's path inside its install root: eagle3_eval/draft.py, eagle3_eval/__init__.py."""
    parts = module.split(".") + (["__init__"] if origin.name == "__init__.py" else [])
    return "/".join(parts) + ".py"


def builder_sources() -> dict[str, Path]:
    """The code whose content decides what this script builds, by a name that does not depend
    on where it is installed.

    This file; the corpus builder it runs (tests/support/tiny_corpus.py); the eagle3_eval and
    eagle3_schemas modules it imports, followed import by import (read from the sources, so the
    set does not depend on what the calling process happens to have imported); and the schema
    files, which eagle3_schemas reads by path to write and validate every artifact. A change to
    a schemas module the assets never import (the fault records, the stream) rebuilds nothing.
    """
    sources = {
        "tests/support/tiny_draft.py": Path(__file__).resolve(),
        "tests/support/tiny_corpus.py": Path(tiny_corpus.__file__).resolve(),
    }
    roots = [*FOLLOWED, *followed_imports(Path(__file__), FOLLOWED)]
    for name, origin in module_sources(roots, FOLLOWED).items():
        sources[_source_name(name, origin)] = origin
    schemas_root = Path(importlib.util.find_spec("eagle3_schemas").origin).parent
    # os.walk, not rglob: schema_files is a symlink to the repository's schemas/ folder.
    for folder, dirs, files in os.walk(schemas_root / "schema_files", followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for file in files:
            path = Path(folder) / file
            sources[path.relative_to(schemas_root.parent).as_posix()] = path
    return dict(sorted(sources.items()))


def assets_key(target: Path, settings: dict[str, object]) -> dict[str, object]:
    """Everything the assets are a function of, by content: no version number to bump by hand.

    The target (weights and tokenizer), the corpus's input, the sources that build and check
    the assets, the settings, and the torch/transformers releases that compute them.
    """
    import transformers

    return {
        "target_fingerprint": fingerprint_model_dir(target),
        "tokenizer_fingerprint": fingerprint_tokenizer_dir(target),
        "stdlib_fingerprint": tiny_corpus.stdlib_fingerprint(tiny_corpus.stdlib_root()),
        "sources": {name: fingerprint_file(path) for name, path in builder_sources().items()},
        "settings": settings,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def default_dir(target: Path, settings: dict[str, object]) -> Path:
    """Cache folder keyed by ``assets_key``: any change to what builds the assets rebuilds them."""
    base = Path(os.environ.get("EAGLE3_CACHE_DIR", Path.home() / ".cache" / "eagle3"))
    key = fingerprint_json(assets_key(target, settings)).removeprefix("sha256:")
    return base / "eval-tiny" / key[:16]


def settings_of(args: argparse.Namespace) -> dict[str, object]:
    return {k: getattr(args, k) for k in DEFAULTS}


def stable_order(rows: list[dict], n: int) -> list[dict]:
    return sorted(
        rows, key=lambda r: hashlib.sha256(r["messages"][-1]["content"].encode()).hexdigest()
    )[:n]


def encode(tokenizer, conv: dict) -> tuple[list[int], list[int]]:
    """Prompt + answer + <|im_end|> + newline, with the answer (and im_end) masked in."""
    prompt = tokenizer.apply_chat_template(
        conv["messages"][:-1], tokenize=False, add_generation_prompt=True
    )
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    answer_ids = tokenizer.encode(
        conv["messages"][-1]["content"] + tokenizer.eos_token, add_special_tokens=False
    )
    tail = tokenizer.encode("\n", add_special_tokens=False)
    ids = prompt_ids + answer_ids + tail
    return ids, [0] * len(prompt_ids) + [1] * len(answer_ids) + [0] * len(tail)


@torch.no_grad()  # not inference_mode: the states feed a training graph later
def capture(target, encoded: list[tuple[list[int], list[int]]], ids: list[int]) -> list[dict]:
    """Per sequence: aux [T, n_aux, H], last (pre-norm, id N) [T, H], ids, mask."""
    layers = target.num_layers
    wanted = tuple(sorted(set([*ids, layers])))
    out = []
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][0]))
    batch = 16
    results: dict[int, dict] = {}
    with capture_aux(target.model, wanted) as captured:
        for start in range(0, len(order), batch):
            chunk = order[start : start + batch]
            longest = max(len(encoded[i][0]) for i in chunk)
            input_ids = torch.zeros(len(chunk), longest, dtype=torch.long)
            attention = torch.zeros(len(chunk), longest, dtype=torch.long)
            for row, i in enumerate(chunk):
                n = len(encoded[i][0])
                input_ids[row, :n] = torch.tensor(encoded[i][0])
                attention[row, :n] = 1
            target.model(input_ids=input_ids, attention_mask=attention)
            states = captured[0]
            for row, i in enumerate(chunk):
                n = len(encoded[i][0])
                seq = states[row, :n].float()
                results[i] = {
                    "aux": seq[:, [wanted.index(k) for k in ids]].clone(),
                    "last": seq[:, wanted.index(layers)].clone(),
                    "ids": torch.tensor(encoded[i][0]),
                    "mask": torch.tensor(encoded[i][1], dtype=torch.bool),
                }
    out = [results[i] for i in range(len(encoded))]
    return out


def draft_vocab(sequences: list[dict], vocab_size: int, size: int) -> tuple[torch.Tensor, float]:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in sequences:
        counts += torch.bincount(s["ids"][s["mask"]], minlength=vocab_size)
    chosen = torch.sort(torch.argsort(counts, descending=True, stable=True)[:size]).values
    coverage = float(counts[chosen].sum() / counts.sum())
    return chosen - torch.arange(size), coverage


def target_log_probs(last: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor, eps: float):
    x = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + eps)
    return F.log_softmax((norm * x) @ lm_head.T, dim=-1)


def train(draft: Eagle3Draft, sequences: list[dict], head: dict, eps: float, args) -> dict:
    """AdamW on the TTT loss for ``steps`` steps (cosine schedule); max_minutes is a safety cap."""
    params = [
        p for n, p in draft.named_parameters() if p.requires_grad and not n.startswith("embed")
    ]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    target_ids = draft.target_ids()
    rng = random.Random(args.seed)
    started = time.monotonic()
    budget = args.max_minutes * 60
    step, order, recent = 0, [], []
    stopped_by_time = False
    while step < args.steps:
        progress = step / args.steps
        if time.monotonic() - started > budget:
            stopped_by_time = True
            break
        lr = (
            args.lr
            * (min(1.0, (step + 1) / 20))
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        total, weight = 0.0, 0.0
        for _ in range(args.seqs_per_step):
            if not order:
                order = list(range(len(sequences)))
                rng.shuffle(order)
            s = sequences[order.pop()]
            length = s["ids"].shape[0]
            steps = chain_logits(draft, s["aux"], s["ids"], K_TRAIN)
            with torch.no_grad():
                teacher = target_log_probs(
                    s["last"], head["norm.weight"], head["lm_head.weight"], eps
                )
            loss = 0.0
            count = 0
            for j, logits in enumerate(steps):
                rows = torch.arange(length - 1 - j)  # row t uses target row t+1+j
                valid = s["mask"][rows + 1 + j]
                if not valid.any():
                    continue
                rows = rows[valid]
                p = teacher[rows + 1 + j][:, target_ids]
                p = torch.softmax(p, dim=-1)  # target restricted to the draft vocabulary
                logq = F.log_softmax(logits[rows], dim=-1)
                loss = loss + (-(p * logq).sum(-1)).sum()
                count += rows.numel()
            if count:
                (loss / (count * args.seqs_per_step) * K_TRAIN).backward()
                total += float(loss.detach())
                weight += count
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        recent = [*recent[-49:], total / max(weight, 1)]
        if step % 25 == 0:
            print(
                f"step {step} loss {sum(recent) / len(recent):.3f} lr {lr:.2e} "
                f"{time.monotonic() - started:.0f}s",
                flush=True,
            )
    return {
        "steps": step,
        "stopped_by_time": stopped_by_time,
        "final_loss": sum(recent) / max(len(recent), 1),
        "seconds": round(time.monotonic() - started, 1),
    }


def write_hidden_states(
    directory: Path, sequences: list[dict], sample_ids: list[str], target, head: dict, lineage: dict
) -> None:
    with atomic_directory(directory) as tmp:
        lengths = [s["ids"].shape[0] for s in sequences]
        tensors = {
            "aux_hidden_states": torch.cat([s["aux"] for s in sequences])
            .numpy()
            .astype(np.float32),
            "last_hidden_state": torch.cat([s["last"] for s in sequences])
            .numpy()
            .astype(np.float32),
            "input_ids": torch.cat([s["ids"] for s in sequences]).numpy().astype(np.int32),
            "loss_mask": torch.cat([s["mask"] for s in sequences]).numpy().astype(np.uint8),
            "cu_seqlens": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        }
        shard = f"{SHARD_DIR}/shard-00000.safetensors"
        write_safetensors(tmp / shard, tensors)
        manifest = {
            k: []
            for k in (
                "sample_id",
                "shard",
                "row_start",
                "num_tokens",
                "num_loss_tokens",
                "checksum",
            )
        }
        start = 0
        for sid, n in zip(sample_ids, lengths, strict=True):
            rows = {
                k: tensors[k][start : start + n].tobytes()
                for k in ("aux_hidden_states", "last_hidden_state", "input_ids", "loss_mask")
            }
            manifest["sample_id"].append(sid)
            manifest["shard"].append(shard)
            manifest["row_start"].append(start)
            manifest["num_tokens"].append(n)
            manifest["num_loss_tokens"].append(int(tensors["loss_mask"][start : start + n].sum()))
            manifest["checksum"].append(checksum_rows(rows))
            start += n
        write_parquet(
            tmp / "manifest.parquet",
            pa.table(
                {
                    "sample_id": manifest["sample_id"],
                    "shard": manifest["shard"],
                    "row_start": pa.array(manifest["row_start"], pa.int64()),
                    "num_tokens": pa.array(manifest["num_tokens"], pa.int32()),
                    "num_loss_tokens": pa.array(manifest["num_loss_tokens"], pa.int32()),
                    "checksum": manifest["checksum"],
                }
            ),
        )
        write_safetensors(
            tmp / "target_head.safetensors", {k: v.contiguous() for k, v in head.items()}
        )
        cfg = target.config
        header = make_header(
            "hidden_states",
            lineage,
            target={
                "architecture": cfg["architectures"][0],
                "hidden_size": cfg["hidden_size"],
                "num_hidden_layers": cfg["num_hidden_layers"],
                "vocab_size": cfg["vocab_size"],
            },
            aux_layer_ids=AUX_LAYER_IDS,
            storage_dtype="float32",
            backend="transformers-hooks",
            num_samples=len(sequences),
            num_tokens=int(sum(lengths)),
            shard_index=0,
            num_shards_total=1,
        )
        write_json_header(tmp / "dataset.json", header)
        problems = validate(tmp)
        if problems:
            raise SystemExit(
                "held-out hidden states do not validate:\n" + "\n".join(map(str, problems))
            )


def build(args) -> Path:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    out: Path = args.out or default_dir(args.target, settings_of(args))
    out.parent.mkdir(parents=True, exist_ok=True)
    # Parallel test sessions (pytest-xdist's workers) may ask for the same folder at once: one
    # builds it, the others wait for the lock and then find it built.
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():
            print(f"already built: {out}")
            return out
        return _build(args, out)


def _build(args, out: Path) -> Path:
    began = time.monotonic()
    with atomic_directory(out) as tmp:
        corpus = tmp / "corpus.jsonl"
        tiny_corpus.write_corpus_jsonl(tiny_corpus.build_corpus(), corpus)
        rows = [json.loads(line) for line in corpus.read_text().splitlines() if line.strip()]
        target = load_target(args.target)
        tok = target.tokenizer

        def usable(split: str, n: int) -> list[dict]:
            picked = [r for r in rows if r["split"] == split]
            encoded = [(r, encode(tok, r)) for r in stable_order(picked, len(picked))]
            return [(r, e) for r, e in encoded if len(e[0]) <= MAX_TOKENS][:n]

        train_rows = usable("train", args.train_conversations)
        heldout_rows = usable("heldout", args.heldout_conversations)
        print(
            f"capturing {len(train_rows)} train / {len(heldout_rows)} held-out conversations",
            flush=True,
        )
        train_seq = capture(target, [e for _, e in train_rows], AUX_LAYER_IDS)
        heldout_seq = capture(target, [e for _, e in heldout_rows], AUX_LAYER_IDS)
        vocab = target.config["vocab_size"]
        d2t, coverage = draft_vocab(train_seq, vocab, args.draft_vocab_size)
        print(
            f"draft vocabulary {args.draft_vocab_size}: {coverage:.4f} of train answer tokens",
            flush=True,
        )
        model = target.model
        head = {
            "norm.weight": model.get_decoder().norm.weight.detach().float().clone(),
            "lm_head.weight": model.get_output_embeddings().weight.detach().float().clone(),
            "embed_tokens.weight": model.get_input_embeddings().weight.detach().float().clone(),
        }
        eps = float(target.config["rms_norm_eps"])
        config = speculators_config(
            target_config=target.config,
            verifier_path=str(args.target.resolve()),
            aux_layer_ids=AUX_LAYER_IDS,
            draft_vocab_size=args.draft_vocab_size,
        )
        spec = DraftSpec.from_config(config)
        draft = random_draft(spec, head["embed_tokens.weight"], d2t, seed=args.seed)
        with torch.no_grad():  # start from the target's head: the draft predicts the same tokens
            draft.lm_head.weight.copy_(head["lm_head.weight"][draft.target_ids()])
            draft.norm.weight.copy_(head["norm.weight"])
        untrained = random_draft(spec, head["embed_tokens.weight"], d2t, seed=args.seed + 1)
        draft.train()
        stats = train(draft, train_seq, head, eps, args)
        draft.eval()
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[torch.arange(len(d2t)) + d2t] = True
        heldout_ids = [conversation_id(r["messages"]) for r, _ in heldout_rows]
        base_lineage = {
            "target_fingerprint": fingerprint_model_dir(args.target),
            "tokenizer_fingerprint": fingerprint_tokenizer_dir(args.target),
        }
        hs_lineage = {
            **base_lineage,
            "tokenized_fingerprint": fingerprint_json(heldout_ids),
            "aux_layer_ids": AUX_LAYER_IDS,
        }
        write_hidden_states(
            tmp / "heldout_hidden_states", heldout_seq, heldout_ids, target, head, hs_lineage
        )
        train_data_fp = fingerprint_json(
            sorted(r["messages"][-1]["content"] for r, _ in train_rows)
        )
        lineage = {
            **base_lineage,
            "hidden_states_fingerprint": train_data_fp,
            "vocab_map_fingerprint": fingerprint_vocab_map(d2t.numpy(), t2d.numpy()),
        }
        training = {
            **stats,
            "tool": "tests/support/tiny_draft.py",
            "train_conversations": len(train_rows),
            "draft_vocab_coverage": coverage,
            "ttt_steps": K_TRAIN,
        }
        for name, m, info in (
            ("draft", draft, training),
            ("random-draft", untrained, {"steps": 0}),
        ):
            header = make_header(
                "draft_checkpoint",
                lineage,
                aux_layer_ids=AUX_LAYER_IDS,
                training=info,
                architecture="llama",
            )
            save_draft(m, tmp / name, config, header.to_json())
            problems = validate(tmp / name)
            if problems:
                raise SystemExit(f"{name} does not validate:\n" + "\n".join(map(str, problems)))
        write_json_atomic(
            tmp / "build.json",
            {
                "target": str(args.target),
                "target_fingerprint": base_lineage["target_fingerprint"],
                "heldout_hidden_states_fingerprint": fingerprint_artifact(
                    tmp / "heldout_hidden_states"
                ),
                "training": training,
                "seconds": round(time.monotonic() - began, 1),
                "settings": settings_of(args),
            },
        )
    print(f"built {out} in {time.monotonic() - began:.0f}s")
    return out


def run_fresh(*args: str, capture: bool = False) -> str:
    """This script in a fresh interpreter (its own threads and memory), ``tests`` on its path;
    its stdout when captured."""
    path = os.pathsep.join(p for p in (str(REPO / "tests"), os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-m", __name__, *args],
        env={**os.environ, "PYTHONPATH": path},
        check=True,
        capture_output=capture,
        text=True,
    )
    return done.stdout if capture else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=TARGET)
    parser.add_argument("--out", type=Path, help="default: a cache folder keyed by the target")
    parser.add_argument("--print-dir", action="store_true")
    # One thread: these tensors are small, and on shared cores a second thread mostly waits.
    parser.add_argument("--threads", type=int, default=1)
    for key, value in DEFAULTS.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args(argv)
    if args.print_dir:
        print(args.out or default_dir(args.target, settings_of(args)))
        return 0
    build(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
