"""The loop over epochs, the data order's segments (stream windows) and micro-batches, and
the end of the run (last validation, checkpoint, export, publication)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from eagle3_train.components.faults import EXIT_PREEMPTED, after_collective_failure
from eagle3_train.components.metrics import MetricWindow, note_corrupt, stream_totals, write_metrics
from eagle3_train.components.preempt import Preemption
from eagle3_train.components.watchdog import StepWatchdog
from eagle3_train.data.batch import ahead_to_device, forward, verify_mode
from eagle3_train.data.loader import make_loader
from eagle3_train.run.deliver import Delivery
from eagle3_train.run.nonfinite import BadStep, NonFiniteSkip, NonFiniteWatch
from eagle3_train.run.setup import Run
from eagle3_train.run.validation import Validation

log = logging.getLogger(__name__)


class Loop:
    """The loop in named steps: one micro-batch (forward, backward, the optimizer step when
    gradients sync), the bookkeeping of an optimizer step (schedule, logging, the save and
    validate points), the end of a segment and of an epoch, and the end of the run."""

    def __init__(self, run: Run, cleanup: list[Callable[[], None]]) -> None:
        self.run = run
        self.t = t = run.config.train
        self.accelerator = accelerator = run.accelerator
        self.state = run.state
        self.main = accelerator.is_main_process
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        self.stream = run.stream
        self.delivery = Delivery(accelerator, run.model, run.inputs, run.arch)
        self.validation = Validation(self.delivery, run.order.validation_idx, run.metrics_path)
        self.progress = None
        if self.main and t.progress_bar:
            self.progress = tqdm(
                total=run.total_steps, initial=self.state.step, desc="train", dynamic_ncols=True
            )
        self.params = [p for p in run.model.parameters() if p.requires_grad]
        self.skip_mode = t.on_non_finite == "skip"
        self.window = MetricWindow(t.ttt_steps, finite_only=self.skip_mode)
        self.lag = 2 if accelerator.device.type == "cuda" else 0
        self.watch: NonFiniteWatch | NonFiniteSkip = (
            NonFiniteSkip(accelerator, self.lag, t.max_skips_in_row)
            if self.skip_mode
            else NonFiniteWatch(accelerator, self.lag)
        )
        self.done = self.state.step >= run.total_steps
        self.preempt = Preemption(t.preempt_signals, accelerator, self.lag)
        self.preempt.install()
        cleanup.append(self.preempt.uninstall)
        self.preempted = False
        self.dog = self._start_watchdog(cleanup)
        self.started = time.perf_counter()  # of the current logging window
        self.corrupt_total = 0  # samples this rank's loader left out (data.on_corrupt: skip)
        self.last_metrics: dict[str, float] = {}
        # stream windows before this one may be released at the end (None: all of them)
        self.released_through: int | None = None if self.state.epoch >= t.epochs else 0
        self.waited = self.stream.wait_seconds if self.stream is not None else 0.0

    def _start_watchdog(self, cleanup: list[Callable[[], None]]) -> StepWatchdog | None:
        """Several ranks, no stream (a stream's waits for the producer are not hangs): a rank
        whose training step has not advanced for train.collective_timeout_s leaves (exit 8, or the
        status of what stopped another rank, where it left its cause)."""
        if self.world <= 1 or self.stream is not None:
            return None
        t, rank, state = self.t, self.rank, self.state

        def hang_message(idle: float) -> str:
            return (
                f"rank {rank}: no training step finished for {idle:.0f} s (over "
                f"train.collective_timeout_s={t.collective_timeout_s:g} s): another rank died "
                "or stopped answering inside a collective. Stopped; last checkpoint: "
                f"{state.last_checkpoint or 'none yet'}. Look at the other ranks' logs, then "
                "relaunch the same command on every node to resume from it"
            )

        def verdict(idle: float) -> tuple[int, str]:
            return after_collective_failure(self.run.config, hang_message(idle))

        dog = StepWatchdog(t.collective_timeout_s, verdict)
        dog.start()
        cleanup.append(dog.stop)
        return dog

    # -- the save and validate points

    def safe_to_keep(self) -> None:
        """Every pending non-finite verdict is read before anything is saved."""
        self.watch.drain(self.run.metrics_path, self.state.last_checkpoint)

    def alone(self):
        """Checkpoints, validation, exports: bounded by the process group's own timeout."""
        return self.dog.paused() if self.dog is not None else contextlib.nullcontext()

    def checkpoint(self) -> None:
        """A checkpoint of this step, once every pending verdict is read (watchdog paused)."""
        self.safe_to_keep()
        with self.alone():
            self._save()

    def _save(self) -> None:
        run = self.run
        run.checkpoints.save(self.accelerator, self.state, run.scheduler, run.model)

    def validate(self) -> None:
        """Validation (and the best draft's export), likewise."""
        self.safe_to_keep()
        with self.alone():
            self.validation.run(self.state, self.last_metrics)

    # -- epochs, segments, micro-batches

    def run_epochs(self) -> None:
        state = self.state
        for epoch in range(state.epoch, self.t.epochs):
            if self.done:
                break
            if epoch != state.epoch:
                state.epoch, state.batches_done = epoch, 0
            epoch_complete = False
            for segment in self.run.order.segments(epoch, state.batches_done):
                self.train_segment(segment, epoch)
                finished = state.batches_done == segment.start + len(segment.batches)
                epoch_complete = finished and segment.last
                if self.done:  # (the loader ends only when the segment is consumed or on done)
                    if segment.window is not None:
                        self.released_through = segment.window + int(finished)
                    break
                self.end_segment(segment)
            if epoch_complete:
                self.end_epoch(epoch)

    def train_segment(self, segment, epoch: int) -> None:
        """The segment's micro-batches until it is consumed or the run is done."""
        config, state = self.run.config, self.state
        loader = make_loader(
            self.run.inputs.dataset,
            segment.batches,
            config.data.num_workers,
            config.data.prefetch_batches,
            pin_memory=torch.cuda.is_available(),
            recycle=True,  # each batch is done with before the one after next is fetched
            verify=verify_mode(config),
        )
        for batch in ahead_to_device(loader, self.accelerator.device, config.train.ttt_steps):
            if "corrupt" in batch:
                found = note_corrupt(batch, state.step + 1, self.rank, self.run.metrics_path)
                self.window.corrupt += found
                self.corrupt_total += found
            loss, stats, grad_norm = self.micro_batch(batch, epoch)
            if self.watch_and_count(loss, stats, batch):
                continue  # inside gradient accumulation
            self.after_optimizer_step(epoch, grad_norm)
            if state.step >= self.run.total_steps:
                self.done = True
                break
            if self.preempt.poll():  # the same step on every rank
                self.preempted = self.done = True
                break

    def micro_batch(
        self, batch, epoch: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Forward, backward and, when gradients sync, the clipped optimizer step, each value
        handed to the non-finite watch: (loss, stats, the step's gradient norm or None)."""
        accelerator, state, watch, run = self.accelerator, self.state, self.watch, self.run
        metrics_path = run.metrics_path
        with accelerator.accumulate(run.model):
            loss, stats = forward(run.model, batch, accelerator, run.config, training=True)
            where = BadStep(
                "loss",
                loss.detach(),
                state.step + 1,
                epoch,
                state.batches_done,
                batch["sample_ids"],
            )
            watch.record(loss, where, metrics_path, state.last_checkpoint)
            accelerator.backward(loss)
            grad_norm = None
            if accelerator.sync_gradients:
                # 0 = no clip (the norm is still measured); DeepSpeed clips by its own config
                limit = self.t.max_grad_norm or float("inf")
                grad_norm = accelerator.clip_grad_norm_(self.params, limit)
                if grad_norm is not None:
                    grad_norm = torch.as_tensor(grad_norm)
                    where = dataclasses.replace(where, what="gradient norm", value=grad_norm)
                    watch.record(grad_norm, where, metrics_path, state.last_checkpoint)
            if accelerator.sync_gradients:
                watch.step_optimizer(run.optimizer)
            else:
                run.optimizer.step()  # (a no-op inside accumulation)
            run.optimizer.zero_grad(set_to_none=True)
        return loss, stats, grad_norm

    def watch_and_count(self, loss: torch.Tensor, stats: torch.Tensor, batch) -> bool:
        """After a micro-batch: its verdicts queued (at an optimizer step), the data position
        and the watchdog advanced, its stats summed. True while gradients still accumulate."""
        accelerator = self.accelerator
        if accelerator.sync_gradients:
            self.watch.end_step(self.run.metrics_path, self.state.last_checkpoint)
        self.state.batches_done += 1
        if self.dog is not None:
            self.dog.kick()
        self.window.add(loss, stats, int(batch["input_ids"].shape[0]))
        return not accelerator.sync_gradients

    def after_optimizer_step(self, epoch: int, grad_norm: torch.Tensor | None) -> None:
        """The schedule advances, the step is counted, logged when due, and the validate and
        save points of train.eval_every / train.save_every are met."""
        t, state = self.t, self.state
        if self.skip_mode:  # the schedule advances over a skipped first step too
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step")
                self.run.scheduler.step()
        else:
            self.run.scheduler.step()
        state.step += 1
        if state.step % t.log_every == 0 or state.step == self.run.total_steps:
            self.log_metrics(epoch, grad_norm)
        if self.progress is not None:
            self.progress.update(1)
        if t.eval_every and state.step % t.eval_every == 0:
            self.validate()
        if t.save_every and state.step % t.save_every == 0:
            self.checkpoint()

    def log_metrics(self, epoch: int, grad_norm: torch.Tensor | None) -> None:
        """The logging window's metrics, reduced over ranks: trackers, metrics.jsonl, the
        progress bar; then a new window."""
        t, state, accelerator = self.t, self.state, self.accelerator
        metrics, tokens = self.window.reduce(accelerator)
        state.tokens += tokens
        metrics.update(lr=self.run.scheduler.get_last_lr()[0], epoch=epoch, tokens=state.tokens)
        if grad_norm is not None:
            metrics["grad_norm"] = float(grad_norm)
        elapsed = time.perf_counter() - self.started
        metrics["tokens_per_s"] = tokens / max(elapsed, 1e-9)
        if self.stream is not None:  # this process's wait for the producer since the last log
            metrics["stream_wait_s"] = self.stream.wait_seconds - self.waited
            metrics["stream_idle_fraction"] = metrics["stream_wait_s"] / max(elapsed, 1e-9)
            self.waited = self.stream.wait_seconds
        self.started = time.perf_counter()
        self.last_metrics = metrics
        self.window = MetricWindow(t.ttt_steps, finite_only=self.skip_mode)
        accelerator.log({f"train/{k}": v for k, v in metrics.items()}, step=state.step)
        if self.main:
            write_metrics(self.run.metrics_path, {"event": "train", "step": state.step, **metrics})
            if self.progress is not None:
                post = {"loss": f"{metrics['loss']:.4f}"}
                post.update(
                    {f"acc{k}": f"{metrics[f'cond_acc_{k}']:.2f}" for k in range(t.ttt_steps)}
                )
                self.progress.set_postfix(post)

    def end_segment(self, segment) -> None:
        """A consumed stream window's shards may go once a checkpoint covers it (then
        receipts, deletes)."""
        if self.stream is None or not self.run.config.data.reclaim or segment.window is None:
            return
        if not self.run.checkpoints.saved_at_step(self.state):
            self.checkpoint()
        self.stream.release(segment.window)
        self.released_through = segment.window + 1

    def end_epoch(self, epoch: int) -> None:
        """Epoch finished: validate, then record the position as the next epoch's start."""
        self.validate()
        self.state.epoch, self.state.batches_done = epoch + 1, 0
        self.checkpoint()
        self.released_through = None

    # -- the end of the run

    def finish(self) -> int:
        """Preempted: checkpoint and leave (exit 5). Otherwise the end's validation and
        checkpoint, the stream's end, the final export, the published draft; exit 0."""
        run, state = self.run, self.state
        if self.progress is not None:
            self.progress.close()
        if self.dog is not None:
            self.dog.stop()  # what follows: checkpoint, validation, export (the group's timeout)
        if self.preempted:
            return self.leave_preempted()
        if state.validated_step != state.step:  # stopped mid-epoch (max_steps): judge the end too
            self.safe_to_keep()
            self.validation.run(state, self.last_metrics)
        if not run.checkpoints.saved_at_step(state):
            self.safe_to_keep()
            self._save()
        if (
            self.stream is not None and self.main
        ):  # after the last checkpoint: what it covers may go
            self.stream.finish(self.released_through)
        self.safe_to_keep()
        final_export = self.delivery.export(state, self.last_metrics)
        self.publish_and_record(final_export)
        self.leave_together()
        return 0

    def leave_preempted(self) -> int:
        """A preemption signal: checkpoint at this step boundary (unless one is there), leave
        together with exit 5. The rerun resumes from it exactly."""
        state, accelerator = self.state, self.accelerator
        self.safe_to_keep()
        if not self.run.checkpoints.saved_at_step(state):
            self._save()
        message = (
            f"preempted by {self.preempt.describe()} (rank {accelerator.process_index}): stopped "
            f"at step {state.step} with checkpoint {state.last_checkpoint}; rerun the same "
            "command to resume"
        )
        if self.main:
            record = {"event": "preempted", "step": state.step, "message": message}
            write_metrics(self.run.metrics_path, record)
        log.warning("%s", message)
        self.leave_together()
        return EXIT_PREEMPTED

    def leave_together(self) -> None:
        """Tear down together, with no engine left: a rank that left early, its DeepSpeed
        engine and gloo work objects still alive, aborted at interpreter exit ("terminate
        called without an active exception", about 1 in 4 two-process ZeRO-3 runs)."""
        accelerator = self.accelerator
        accelerator.free_memory()
        accelerator.wait_for_everyone()
        accelerator.end_training()

    def publish_and_record(self, final_export: Path | None) -> None:
        """The best export (else the final one) copied to OUTPUT/draft, and the "done" event
        with the corrupt samples left out on every rank and the stream's totals."""
        config, state, accelerator = self.run.config, self.state, self.accelerator
        corrupt_all = self.corrupt_total
        if config.data.verify_rows and config.data.on_corrupt == "skip" and self.world > 1:
            total = torch.tensor([float(self.corrupt_total)], device=accelerator.device)
            corrupt_all = int(accelerator.reduce(total, reduction="sum").item())
        if not self.main:
            return
        chosen = Path(state.best_export) if state.best_export else final_export
        assert chosen is not None
        published = self.delivery.publish(chosen)
        write_metrics(
            self.run.metrics_path,
            {
                "event": "done",
                "step": state.step,
                "draft": str(published),
                "best_step": state.best_step,
                **({"corrupt_samples": corrupt_all} if corrupt_all else {}),
                **(stream_totals(self.stream, self.run.started) if self.stream is not None else {}),
            },
        )
        log.info("done: %d steps; draft at %s (from %s)", state.step, published, chosen)
