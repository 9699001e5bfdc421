"""The one training loop: batch → objective (model + loss) → backward through the accelerator.

It reads the same for every launch; how this launch is distributed is decided once in `launch_plan.py` (and carried
out by `accelerator.py`, `fsdp.py`, `deepspeed.py`, `grad_cache.py`), and what differs between
kinds of model (contrastive retrieval, flow matching: data, objective, evaluation, plots) in `vembed.tasks`. The
loop says when; how is elsewhere: the stages and their loaders in `stages.py` and `train_loader.py` (streamed data:
`streamed.py`), what a log line reports in `log_meter.py`, and the end-of-run outputs in `run_outputs.py`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vembed.errors import CheckpointError, DataError, TrainingError
from vembed.training.checkpoint import (
    CheckpointManager,
    TrainerState,
    is_better,
    resolve_resume,
    writing_checkpoint_files,
)
from vembed.training.profiling import StepProfiler
from vembed.training.run_outputs import (
    read_metrics,
    save_final_model,
    write_end_of_run,
    write_metrics_before_training,
)
from vembed.training.log_meter import LogMeter
from vembed.training.preemption import Preempted, StopRequests
from vembed.training.throughput import ThroughputMeter

if TYPE_CHECKING:
    from accelerate import Accelerator

    from vembed.recipe import Recipe
    from vembed.training.stages import Stage
    from vembed.training.threads import ThreadChoice

logger = logging.getLogger("vembed")


FUSED_ADAMW_DEVICES = frozenset({"cuda", "cpu", "xpu", "mps", "hpu"})  # device types with torch's fused AdamW


def build_optimizer(groups: list[dict], lr: float) -> torch.optim.Optimizer:
    """AdamW with torch's fused kernel when every parameter can use it, as transformers' Trainer picks by default: one
    kernel for all tensors instead of a loop over them (on CPU 7x faster for a 22M-parameter model, ~20% of a training
    step). torch checks support only at the first step, so it is decided here from the parameters. A group's `lr_scale`
    (layer-wise decay) sets its own rate; the schedule then scales every group's rate alike."""
    fused = all(param.is_floating_point() and param.device.type in FUSED_ADAMW_DEVICES
                for group in groups for param in group["params"])
    groups = [{**group, "lr": lr * group["lr_scale"]} if "lr_scale" in group else group for group in groups]
    return torch.optim.AdamW(groups, lr=lr, fused=fused or None)


@dataclass
class TrainResult:
    output_dir: Path
    final_model_dir: Path
    metrics: dict[str, Any]
    state: TrainerState


class Trainer:
    """Holds what the loop needs; `run()` trains, evaluates and exports. One instance per launch."""

    def __init__(self, recipe: "Recipe", accelerator: "Accelerator | None" = None,
                 threads: "ThreadChoice | None" = None):
        from vembed.tasks import task_for
        from vembed.training.accelerator import build_accelerator, check_accelerator_matches
        from vembed.training.launch_plan import decide_launch
        from vembed.training.run_dir import check_output_dir, run_identity

        self.recipe = recipe
        self.threads = threads  # the entrypoint's choice of intra-op threads (None: the caller's torch setting)
        self.output_dir = Path(recipe.output_dir)
        self.identity = run_identity(recipe)  # stored with every checkpoint: whose run it is
        # Before anything is read or built: a folder that cannot be written, or holds another run's work, stops here.
        check_output_dir(recipe)
        self.task = task_for(recipe)(recipe)
        # Every launch decision and refusal first: before a data row or a weight is read.
        plan = decide_launch(recipe)
        self.train_report = self.task.load_train_data()
        self.eval_examples, self.test_examples = self.task.load_held_out()  # their images decoded: before any weight
        # Whether every batch reaches every parameter decides how DDP is set up.
        self.plan = plan.with_unused_parameter_search(not self.task.every_step_uses_every_parameter())
        if accelerator is None:
            accelerator = build_accelerator(recipe, self.plan)
        else:
            check_accelerator_matches(accelerator, self.plan)
        self.accelerator = accelerator
        self.resume_path = self._resolve_resume()  # verified now: a damaged or foreign checkpoint stops the launch
        self._nonfinite_loss: torch.Tensor | float = 0.0  # micro-batches since the last step whose loss was NaN/Inf
        self.stop_requests = StopRequests()  # SIGTERM/SIGUSR1 while `run` trains (preemption.py)
        self._stop_agreed = False  # some rank had a stop request at the last optimizer step: every rank stops

    def _resolve_resume(self) -> Path | None:
        """The checkpoint to resume from, verified by the main process (it reads every byte once) and shared."""
        acc = self.accelerator
        if self.recipe.resume_from is None:
            return None
        outcome: list[Any] = [None]
        if acc.is_main_process:
            try:
                found = resolve_resume(self.recipe.resume_from, self.output_dir, self.identity, warn=acc.print)
                outcome = [("path", str(found) if found else None)]
            except CheckpointError as error:
                outcome = [("error", error.args[0])]
        if acc.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(outcome)
        kind, value = outcome[0]
        if kind == "error":
            raise CheckpointError(value)
        return Path(value) if value else None

    # --- building --------------------------------------------------------------------------------------------------
    def build(self) -> None:
        """Model, objective, data loader, optimizer and scheduler, prepared by the accelerator; `run` starts here.
        Tests and benchmarks call it to drive single steps (`train_on_batch`)."""
        from accelerate.utils import set_seed
        from torch.utils.data import IterableDataset

        from vembed.training.deepspeed import configure_deepspeed, unsharded_construction
        from vembed.training.lr import learning_rate_for
        from vembed.training.objective import parameter_groups
        from vembed.training.schedules import get_scheduler
        from vembed.training.stages import staged_scheduler

        recipe, acc, plan = self.recipe, self.accelerator, self.plan
        set_seed(recipe.seed)
        with unsharded_construction(acc, unless_zero3_init=True):
            self.objective = self.task.build_objective()
        if plan.compile:  # the plan allowed it: an encoder adapter, no FSDP/DeepSpeed
            self.objective.adapter.compile_towers()
        if plan.fsdp is not None:
            from vembed.training.fsdp import shard_objective

            shard_objective(self.objective, recipe, acc, plan.fsdp)  # before the optimizer: it sees the shards

        self.dataset, self.collate = self.task.train_dataset(self.objective)
        self._check_cached_decode_failures()
        if isinstance(self.dataset, IterableDataset):  # streamed: it shards, shuffles and batches itself
            loader, self.stages = None, []
            self._plan_streamed_epochs()
        else:
            self.stream = None
            loader = self._plan_stages()
        lr = learning_rate_for(recipe, acc.num_processes, log=acc.print)  # scale_lr_with_world_size, logged once
        own_rates = self.task.learning_rate_scales(self.objective)
        optimizer = build_optimizer(parameter_groups(self.objective, recipe.weight_decay, recipe.layer_lr_decay,
                                                     own_rates), lr)
        if len(self.stages) > 1:
            scheduler = staged_scheduler(optimizer, self.stages, recipe.scheduler_type, recipe.warmup_ratio,
                                         recipe.learning_rate)
        else:
            scheduler = get_scheduler(
                recipe.scheduler_type,
                optimizer,
                num_warmup_steps=int(recipe.warmup_ratio * self.total_steps),
                num_training_steps=self.total_steps,
            )
        configure_deepspeed(acc, recipe, self.objective)
        # The streamed loader stays unprepared: accelerate would read the stream on rank 0 and dispatch it.
        parts = (optimizer, scheduler) if loader is None else (optimizer, loader, scheduler)
        if plan.fsdp is None:
            self.model, *prepared = acc.prepare(self.objective, *parts)
        else:  # already sharded: accelerate prepares the rest and must not wrap the model again
            prepared = list(acc.prepare(*parts))
            self.model = self.objective
        self.optimizer, self.scheduler = prepared[0], prepared[-1]
        self.loader = prepared[1] if loader is not None else None
        if self.stages:
            self._prepare_stage_loaders()
        self.weight_average = None
        if recipe.ema_decay is not None:  # registered before any resume loads the checkpoint that holds it
            from vembed.training.ema import WeightAverage

            self.weight_average = WeightAverage(self.adapter, recipe.ema_decay)
            acc.register_for_checkpointing(self.weight_average)
        sharded = (self.model, self.optimizer, self.scheduler) if plan.fsdp is not None else None
        self.checkpoints = CheckpointManager(acc, self.output_dir, recipe.save_total_limit, recipe.persistent_dir,
                                             sharded=sharded, identity=self.identity)
        from vembed.training.grad_cache import build_train_step

        self.train_step = build_train_step(acc, self.model, plan.grad_cache)

    def _plan_stages(self) -> Any:
        """The curriculum (one stage without `stages:`, planned in stages.py): the run's total steps, and the first
        stage's figures under the names the single-stage loop always had. Returns the first stage's loader, which
        is prepared with the model."""
        from vembed.training.stages import planned_stages

        self.stages = planned_stages(self.recipe, self.dataset, self.collate, self.accelerator.num_processes)
        self.total_steps = self.stages[-1].end_step
        first = self.stages[0]
        self.batches_per_epoch, self.steps_per_epoch, self.num_epochs = (first.batches_per_epoch,
                                                                         first.steps_per_epoch, first.num_epochs)
        return first.loader

    def _prepare_stage_loaders(self) -> None:
        self.stages[0].loader = self.loader
        for stage in self.stages[1:]:
            stage.loader = self.accelerator.prepare(stage.loader)
        for stage in self.stages:
            if len(stage.loader) != stage.batches_per_epoch:  # the schedule must count what each process iterates
                raise TrainingError(f"internal: the prepared loader yields {len(stage.loader)} batches per process, "
                                    f"the schedule was planned for {stage.batches_per_epoch}")

    def _plan_streamed_epochs(self) -> None:
        """The schedule of a streamed run (planned in streamed.py)."""
        from vembed.training.streamed import StreamedEpochs

        self.stream = StreamedEpochs(self.dataset, self.train_report, self.recipe, self.accelerator)
        self.batches_per_epoch, self.steps_per_epoch, self.total_steps, self.num_epochs = self.stream.schedule()

    def _enter_stage(self, state: TrainerState) -> "Stage":
        """Make stage `state.stage` the current one: its loader, its inputs (max_length, image size)."""
        stage = self.stages[state.stage]
        if state.stage > 0:
            previous = self.stages[state.stage - 1].loader
            # A finished stage's persistent DataLoader workers are let go (torch shuts them down with the iterator).
            for loader in (previous, getattr(previous, "base_dataloader", None)):
                if loader is not None and getattr(loader, "_iterator", None) is not None:
                    loader._iterator = None
        self.loader = stage.loader
        self.task.enter_stage(self.objective, stage)
        if len(self.stages) > 1:
            self.accelerator.print(f"stage {stage.index + 1}/{len(self.stages)} {stage.name}: steps "
                                   f"{stage.first_step + 1}-{stage.end_step}, {stage.num_epochs} epoch(s), peak "
                                   f"learning rate {stage.learning_rate:g}")
        return stage

    def _set_epoch(self, stage: "Stage", epoch: int) -> None:
        # The prepared loader hands its own epoch counter to a plain sampler on every pass; set it explicitly so a
        # resumed run replays the same order as an uninterrupted one. A batch sampler under accelerate's shard is
        # not reached that way: it is set directly.
        stage.loader.set_epoch(epoch)
        if stage.batch_sampler is not None:
            stage.batch_sampler.set_epoch(epoch)

    @property
    def adapter(self):
        # The objective built in _build is the module every wrapper (DDP, FSDP, DeepSpeed) holds, so no unwrapping:
        # accelerate's unwrap_model imports deepspeed whenever it is installed, seconds of start-up.
        return self.objective.adapter

    # --- evaluation ------------------------------------------------------------------------------------------------
    def evaluate(self, examples: Any) -> dict[str, float]:
        """The task's metrics of the model on held-out data (validation or test split), as one process computes them
        on the saved weights: forward passes go through the prepared model, with FSDP's weights gathered in float32."""
        from vembed.training.fsdp import full_precision_gathers

        with full_precision_gathers(self.model), self._averaged_weights():
            return self.task.evaluate(self.adapter, examples, self.accelerator, prepared=self.model)

    def _averaged_weights(self):
        """The weight average (ema_decay) lent to the model for an evaluation; nothing without one."""
        from contextlib import nullcontext

        return nullcontext() if self.weight_average is None else self.weight_average.lent_to(self.adapter)

    # --- the loop --------------------------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        """Train, evaluate and export, holding output_dir's run lock (on the main process) throughout."""
        from vembed.training.run_dir import RunLock

        lock = RunLock(self.output_dir).acquire() if self.accelerator.is_main_process else None
        try:
            with self.stop_requests:
                return self._run()
        finally:
            if lock is not None:
                lock.release()  # also removes an output_dir this launch created and left empty

    def _run(self) -> TrainResult:
        from tqdm.auto import tqdm

        recipe, acc = self.recipe, self.accelerator
        self.build()  # model and data first: if either fails, output_dir is left untouched
        from vembed.training.deepspeed import unsharded_construction
        from vembed.training.sharded_state import count_parameters
        from vembed.training.start_block import describe_launch, launch_record, memory_estimate_line

        trainable, total = count_parameters(self.objective)
        self.launch = launch_record(self.plan, acc, recipe, trainable, total,
                                    contrastive=self.task.uses_gradient_cache)  # for the model card
        acc.print(describe_launch(self.plan, acc, recipe, trainable, total, self.task.batch_lines(self.plan.world_size),
                                  grad_cache_applies=self.task.uses_gradient_cache, threads=self.threads))
        if acc.is_main_process:
            # The planner's meta-device model must not go through ZeRO-3's (collective) construction hook.
            with unsharded_construction(acc):
                acc.print(memory_estimate_line(self.plan, recipe, acc.device.type))
        acc.print(f"data                {self.train_report.summary()}")

        state, metrics = self._start_or_resume()
        if recipe.report_to:  # trackers write under output_dir: only once the run has claimed it
            acc.init_trackers(recipe.run_name or "vembed", config=_flat_config(recipe.to_dict()))
        self._profiler = StepProfiler(recipe.profile, acc, self.adapter, self.optimizer, self.output_dir)
        progress = tqdm(total=self.total_steps, initial=state.global_step, disable=not acc.is_local_main_process,
                        desc="train", dynamic_ncols=True)
        try:
            self._train(state, progress)
        finally:
            progress.close()  # also on errors, so the message is not glued to a half-drawn bar
            self._profiler.close()
        if self.stop_requests.requested:
            acc.print(f"note: {self.stop_requests.signal_name} arrived at the last step; the run finishes")
        return self._finish(state, metrics)

    def _start_or_resume(self) -> tuple[TrainerState, dict[str, Any]]:
        """A fresh state (with the untrained model's metrics) or the state of the checkpoint to resume from."""
        recipe, acc = self.recipe, self.accelerator
        self._last_saved_step: int | None = None
        resume_path = self.resume_path
        if resume_path is not None:
            state = self.checkpoints.load(resume_path)
            self._last_saved_step = state.global_step
            self._claim_output_dir()
            acc.print(f"resumed from {resume_path} at step {state.global_step}")
            return state, read_metrics(self.output_dir)
        self._claim_output_dir()
        metrics: dict[str, Any] = {}
        if recipe.eval_before_training and self.eval_examples:
            metrics["before"] = self.evaluate(self.eval_examples)
            acc.print(f"before training: {self.task.headline(metrics['before'])}")
            if acc.is_main_process:
                write_metrics_before_training(self.output_dir, metrics)  # keeps "before" across a resume
        return TrainerState(), metrics

    def _claim_output_dir(self) -> None:
        """The first write into output_dir, once every refusal is past: the previous run's outputs go (with
        overwrite_output_dir), this run's recipe and identity are recorded."""
        from vembed.training.run_dir import RECIPE_FILE, clear_previous_run, write_run_file

        if self.accelerator.is_main_process:
            if self.recipe.overwrite_output_dir:
                clear_previous_run(self.output_dir)
            with writing_checkpoint_files(RECIPE_FILE, self.output_dir, self.checkpoints.last_good):
                self.output_dir.mkdir(parents=True, exist_ok=True)
                self.recipe.save(self.output_dir / RECIPE_FILE)
                write_run_file(self.output_dir, self.identity)
        self.accelerator.wait_for_everyone()  # no rank writes a checkpoint before the old ones are gone

    def _train(self, state: TrainerState, progress) -> None:
        if self.stream is not None:
            return self._train_streamed(state, progress)
        acc = self.accelerator
        meter = self._meter()
        self.model.train()
        done = state.global_step >= self.total_steps
        while not done and state.stage < len(self.stages):
            stage = self._enter_stage(state)
            stage_done = state.global_step >= stage.end_step
            while not stage_done and state.epoch < stage.num_epochs:
                self._set_epoch(stage, state.epoch)
                loader = stage.loader
                if state.batches_in_epoch:
                    loader = acc.skip_first_batches(stage.loader, state.batches_in_epoch)
                for batch in loader:
                    done = self._train_one(batch, state, meter, progress)
                    stage_done = state.global_step >= stage.end_step
                    if stage_done:
                        break
                # Without `stage_done` the loader ran out; with it, the last step may also have been the epoch's end.
                if not stage_done or state.batches_in_epoch >= stage.batches_per_epoch:
                    state.epoch += 1
                    state.batches_in_epoch = 0
                    self._check_decode_failures()
                    if not done:
                        self._maybe_evaluate_and_save(state, end_of_epoch=True, done=False)
            if not done:
                state.stage, state.epoch, state.batches_in_epoch = state.stage + 1, 0, 0

    def _source_names(self) -> list[str]:
        """The named training sources, whose losses are logged apart; none for a split without names."""
        ranges = self.dataset.source_ranges() if hasattr(self.dataset, "source_ranges") else []
        return [name for name, _, _ in ranges if name is not None]

    def _meter(self) -> LogMeter:
        acc = self.accelerator
        # Kept for the checkpoints: a save between two log lines takes the steps since the last line into the state
        self._log_meter = LogMeter(samples_per_batch=self.recipe.batch_size * acc.num_processes,
                                   throughput=ThroughputMeter(self.adapter, acc, acc.mixed_precision),
                                   sources=self._source_names(),
                                   length_chunks=getattr(self.objective, "length_chunks", 1))
        return self._log_meter

    def _train_one(self, batch: dict[str, Any], state: TrainerState, meter: LogMeter, progress) -> bool:
        """One micro-batch and, once gradients are accumulated, the step's schedule, logging, evaluation and saving.
        Whether training is done."""
        loss = self.train_on_batch(batch, state)
        state.batches_in_epoch += 1
        state.samples_seen += meter.samples_per_batch
        meter.add(loss, batch)
        self._profiler.step()
        if not self.accelerator.sync_gradients:
            return False
        self.scheduler.step()
        state.global_step += 1
        meter.end_step()
        progress.update(1)
        if state.global_step % self.recipe.logging_steps == 0 or state.global_step == self.total_steps:
            self._log(state, meter, progress)
            self._check_decode_failures()
        done = state.global_step >= self.total_steps
        if self._stop_agreed and not done:
            self._stop_after_step(state)
        self._maybe_evaluate_and_save(state, end_of_epoch=False, done=done)
        return done

    def _stop_after_step(self, state: TrainerState) -> None:
        """A stop signal reached some rank: every rank is here after the same step. One checkpoint of it, verified, then
        the run ends with `Preempted` (exit code 75). An evaluation due at this step is skipped: the grace period a
        cluster gives (30 s by Kubernetes' default) is for the checkpoint."""
        if self.stream is not None:
            state.stream = self.stream.state()  # collective: every rank's position in the stream
        path = self.checkpoints.save_verified(state)
        self._last_saved_step = state.global_step
        name = self.stop_requests.signal_name or "a stop signal on another rank"
        raise Preempted(state.global_step, name, path, resumes_by_itself=self.recipe.resume_from == "auto")

    def _train_streamed(self, state: TrainerState, progress) -> None:
        """`_train` for streamed data (vembed/training/streamed.py): an epoch is one pass over the shards, ended on
        every rank when one runs out; a resumed run continues each stream from the checkpoint's position."""
        from contextlib import closing

        from vembed.errors import DataError

        meter = self._meter()
        self.model.train()
        saved = state.stream  # the checkpoint's position, for the epoch it was saved in
        done = state.global_step >= self.total_steps
        while not done and (self.num_epochs is None or state.epoch < self.num_epochs):
            with closing(self.stream.epoch_batches(state.epoch, state.batches_in_epoch, saved)) as batches:
                for batch in batches:
                    done = self._train_one(batch, state, meter, progress)
                    if done:
                        break
            saved = None
            planned = self.stream.planned_batches(state.epoch)
            if done and (planned is None or state.batches_in_epoch < planned):
                break
            if state.batches_in_epoch == 0:
                raise DataError(f"epoch {state.epoch} of data.train gave no full batch on some rank; lower "
                                "batch_size or data.num_workers, or add shards", file=self.dataset.files[0])
            state.epoch += 1
            state.batches_in_epoch = 0
            if not done:
                self._maybe_evaluate_and_save(state, end_of_epoch=True, done=False)
        self.stream.update_report()  # collective: the skip counts of every rank, for the report and metrics.json
        for epoch, taken, planned in self.stream.ran_short:
            self.accelerator.print(f"warning: epoch {epoch} ended after {taken} of {planned} planned batches per "
                                   f"rank (skipped samples); {self.train_report.summary()}")

    def train_on_batch(self, batch: dict[str, Any], state: TrainerState) -> torch.Tensor:
        """Forward and backward of one batch, then (once gradients are accumulated) the checked, clipped optimizer
        step; the detached loss. All the model work of one loop iteration (bench/step_overhead.py times it)."""
        acc = self.accelerator
        self.task.begin_step(self.objective, state.global_step, self.total_steps)
        with acc.accumulate(self.model):
            loss = self.train_step(batch)  # forward + backward: plain, or GradCache's chunked passes
            # Kept on the device (no host sync per micro-batch); read with the gradient norm at the optimizer step.
            self._nonfinite_loss = self._nonfinite_loss + (~torch.isfinite(loss.detach())).sum()
            if acc.sync_gradients:
                self._check_and_clip(state)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if acc.sync_gradients and self.weight_average is not None:
                self.weight_average.update(self.adapter)
        return loss

    def _decode_counts(self) -> tuple[int, int, int | None]:
        """(fetched, replaced, a replaced index) over every rank and DataLoader worker. Collective."""
        counts = self.dataset.decode_counts()
        local = torch.tensor([counts.fetched, counts.replaced, -1 if counts.first_bad is None else counts.first_bad],
                             device=self.accelerator.device)
        every = self.accelerator.gather(local.unsqueeze(0)) if self.accelerator.num_processes > 1 else local[None]
        marked = [int(i) for i in every[:, 2].tolist() if i >= 0]
        return int(every[:, 0].sum()), int(every[:, 1].sum()), marked[0] if marked else None

    def _check_cached_decode_failures(self) -> None:
        """data.max_bad_fraction before step 1 when the image cache is on: building it decoded every training image,
        so the share of records that would be replaced is known exactly, not sampled from the batches."""
        cache = getattr(self.dataset, "image_cache", None)
        if cache is None:
            return
        from vembed.data.image_cache import undecodable_records
        from vembed.data.reports import unusable_share

        bad, first = undecodable_records(self.dataset.examples, cache)
        report, limit = self.train_report, self.recipe.data.max_bad_fraction
        share = unusable_share(report, bad)
        if bad and share > limit:
            example, why = self.dataset.examples[first], self.dataset.decode_error(first)
            raise DataError(
                f"{bad} of {report.kept} training records have images that do not decode (found when the image cache "
                f"decoded every image; with the {report.num_skipped} rows skipped when reading, {share:.0%} of "
                f"data.train is unusable > data.max_bad_fraction={limit}); this row: {why}; fix or remove the broken "
                "image files, or raise data.max_bad_fraction",
                file=example.source, row=example.row,
            )

    def _check_decode_failures(self) -> None:
        """data.max_bad_fraction over what training has seen: rows skipped when the files were read, plus records
        whose images failed to decode when fetched. The decode share is a sample; the run stops once it is clearly
        above the limit (the 99% lower confidence bound is), so a few unlucky first batches do not end it."""
        if not hasattr(self.dataset, "decode_counts"):
            return
        fetched, replaced, first = self._decode_counts()
        if not replaced:
            return
        from vembed.data.reports import unusable_share

        report, limit = self.train_report, self.recipe.data.max_bad_fraction
        share = unusable_share(report, wilson_lower_bound(replaced, fetched) * report.kept)
        if share <= limit:
            return
        example = self.dataset.examples[first] if first is not None else None
        why = self.dataset.decode_error(first) if first is not None else None
        raise DataError(
            f"{replaced} of {fetched} training records fetched so far had images that would not decode "
            f"({replaced / fetched:.0%}; with the {report.num_skipped} rows skipped when reading, at least "
            f"{share:.0%} of data.train is unusable > data.max_bad_fraction={limit})"
            f"{f'; this row: {why}' if why else ''}; fix or remove the broken image files, or raise "
            "data.max_bad_fraction",
            file=getattr(example, "source", None), row=getattr(example, "row", None),
        )

    def _log(self, state: TrainerState, meter: LogMeter, progress) -> None:
        acc = self.accelerator
        record = meter.record(acc, state.global_step, self.scheduler.get_last_lr()[0])
        state.loss_history.append(record)
        state.step_losses.extend(meter.take_step_records(acc, state.global_step))  # every step's, unrounded
        progress.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                             sps=f"{record['samples_per_second']:.0f}", mem=f"{record['peak_memory_mb']:.0f}MB",
                             **({"mfu": f"{record['mfu']:.1%}"} if "mfu" in record else {}))
        acc.log({f"train/{k}": v for k, v in record.items() if k != "step"}, step=state.global_step)
        meter.reset()

    def _check_and_clip(self, state: TrainerState) -> None:
        # The gradient norm is computed after DDP's all-reduce, so every rank sees the same value; the losses are each
        # rank's own, so their flag is summed over ranks: every rank stops together, none is left in a collective.
        # An infinite loss can come with finite gradients (a saturated loss term), so both are checked.
        acc = self.accelerator
        max_norm = self.recipe.max_grad_norm if self.recipe.max_grad_norm is not None else float("inf")
        norm = acc.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):  # FSDP: a DTensor holding each rank's partial norm
            norm = norm.full_tensor()
        bad_norm = torch.zeros((), device=acc.device) if norm is None else (
            ~torch.isfinite(torch.as_tensor(norm, device=acc.device))).float()
        # A stop signal (preemption.py) rides on the same reduction: one collective per step tells every rank both.
        stop = torch.full((), float(self.stop_requests.requested), device=acc.device)
        flags = torch.stack([torch.as_tensor(self._nonfinite_loss, device=acc.device).float(), bad_norm, stop])
        self._nonfinite_loss = 0.0
        if acc.num_processes > 1:
            flags = acc.reduce(flags, "sum")
        bad_loss, bad_gradients, stops = flags.tolist()
        self._stop_agreed = stops > 0
        if bad_loss or bad_gradients:
            what = "the loss" if bad_loss else "the gradients"
            last = self.checkpoints.last_good or "none saved yet"
            raise TrainingError(
                f"{what} became NaN/Inf at step {state.global_step + 1} (epoch {state.epoch}); weights were not "
                f"updated; last good checkpoint: {last}. Lower learning_rate or set max_grad_norm"
            )

    def _maybe_evaluate_and_save(self, state: TrainerState, *, end_of_epoch: bool, done: bool) -> None:
        """Evaluate every `eval_steps` (or at each epoch end) and save every `save_steps` and whenever the validation
        metric improves. At the last step nothing is saved here: `final/` is written instead."""
        recipe = self.recipe
        step = state.global_step
        if end_of_epoch:
            due_eval, due_save = recipe.eval_steps is None, False
        else:
            due_eval = recipe.eval_steps is not None and step % recipe.eval_steps == 0
            due_save = recipe.save_steps is not None and step % recipe.save_steps == 0
        improved = False
        if due_eval and self.eval_examples:
            result = self.evaluate(self.eval_examples)
            # Trackers and the history take numbers; reports (a task's per-class table, confusion matrix) go to
            # metrics.json with the final evaluation.
            numbers = {k: v for k, v in result.items() if isinstance(v, (int, float))}
            state.eval_history.append({"step": step, **numbers})
            self.accelerator.log({f"eval/{k}": v for k, v in numbers.items()}, step=step)
            value = result.get(recipe.metric_for_best_model)
            if value is None:
                self.accelerator.print(
                    f"warning: metric_for_best_model {recipe.metric_for_best_model!r} is not among the evaluation "
                    f"metrics ({', '.join(sorted(result))}); no best checkpoint is tracked"
                )
            improved = is_better(value, state.best_metric)
            if improved:
                state.best_metric = value
                state.best_checkpoint = f"checkpoint-{step}" if recipe.save_steps is not None else None
            self.model.train()
        if done or step == self._last_saved_step:
            return
        if due_save or (improved and recipe.save_steps is not None):
            if self.stream is not None:
                state.stream = self.stream.state()  # collective: every rank's position in the stream
            state.step_losses.extend(self._log_meter.take_step_records(self.accelerator, step))  # collective
            self.checkpoints.save(state)
            self._last_saved_step = step

    def _finish(self, state: TrainerState, metrics: dict[str, Any]) -> TrainResult:
        """final/ (the weights first: an evaluation that fails must not cost them), then the evaluation of the trained
        model, metrics.json and the plots, then the model card that reports them, written into final/
        (run_outputs.py writes each)."""
        from vembed.training.sharded_state import gather_full_state_dict

        acc, recipe = self.accelerator, self.recipe
        self._check_decode_failures()
        acc.wait_for_everyone()
        if self.weight_average is not None:  # final/ (and its evaluation) is the average, not the last step
            self.weight_average.copy_into(self.adapter)
            self.weight_average = None
        full_state = gather_full_state_dict(acc, self.model) if self.plan.sharded else None
        final_dir = save_final_model(acc, self.output_dir, self.adapter, recipe, full_state,
                                     self.checkpoints.last_good, loss=self.objective.loss)
        if self.eval_examples:
            metrics["validation"] = self.evaluate(self.eval_examples)
        if self.test_examples:
            metrics["test"] = self.evaluate(self.test_examples)
        metrics["train"] = {
            "steps": state.global_step,
            "epochs_completed": sum(stage.num_epochs for stage in self.stages[: state.stage]) + state.epoch,
            "samples_seen": state.samples_seen,
            "world_size": acc.num_processes,
            "final_loss": state.loss_history[-1]["loss"] if state.loss_history else None,
            "data": self.train_report.to_dict(),
            "decode_failures": self._decode_counts()[1] if hasattr(self.dataset, "decode_counts") else 0,
            "loss": self.objective.loss.config,
        }
        metrics["loss_history"] = state.loss_history
        metrics["step_losses"] = state.step_losses
        metrics["eval_history"] = state.eval_history
        metrics["best"] = {"metric": recipe.metric_for_best_model, "value": state.best_metric,
                           "checkpoint": state.best_checkpoint}
        if acc.is_main_process:
            write_end_of_run(self.output_dir, final_dir, metrics, recipe=recipe, task=self.task,
                             train_data=self.train_report.to_dict(), launch=getattr(self, "launch", None) or {},
                             last_good=self.checkpoints.last_good, warn=acc.print)
            if self.train_report.num_skipped:
                acc.print(f"warning: {self.train_report.summary()}")
            failures = metrics["train"]["decode_failures"]
            if failures:
                acc.print(f"warning: {failures} fetched training record(s) had images that would not decode and "
                          "were replaced")
            for name in ("before", "validation", "test"):
                if metrics.get(name):
                    acc.print(f"{name:<11} {self.task.headline(metrics[name])}")
            acc.print(f"final model: {final_dir}")
        # Ranks leave together: one that went on to tear down gloo while rank 0 still wrote could abort (SIGABRT).
        acc.wait_for_everyone()
        return TrainResult(self.output_dir, final_dir, metrics, state)


def wilson_lower_bound(successes: int, trials: int, z: float = 2.326) -> float:
    """One-sided 99% lower confidence bound of a proportion (Wilson score interval)."""
    if trials == 0:
        return 0.0
    p = successes / trials
    centre = p + z * z / (2 * trials)
    spread = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    return max(0.0, (centre - spread) / (1 + z * z / trials))


def _flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    # Trackers (tensorboard hparams) accept only scalars.
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flat_config(value, f"{name}."))
        elif isinstance(value, (int, float, str, bool)):
            flat[name] = value
        elif value is not None:
            flat[name] = str(value)
    return flat


def train(recipe: "Recipe", accelerator: "Accelerator | None" = None) -> TrainResult:
    return Trainer(recipe, accelerator).run()
