"""The mutation check (`make mutations`): break one contract at a time and show that a test fails for each.

Each mutation below replaces one piece of the package's source (text found exactly once) by a broken version,
runs the tests named for it, and restores the file whatever happens. A mutation is caught when those tests fail
(pytest exit 1); one whose tests still pass is a claim no test guards. The selected tests are first run on the
unbroken source, which must pass, or the check proves nothing.

    python tests/mutations/run.py              # every mutation (about 10 minutes on 2 CPU cores)
    python tests/mutations/run.py NAME ...     # some of them; --list names them

Not part of CI: it takes long, and it edits the working tree while it runs (do not edit files meanwhile).
It refuses to start while tracked files have uncommitted changes (untracked files are left alone: it never
touches them), so every file it breaks is the committed one and `git checkout -- FILE` restores it. SIGTERM,
SIGINT and SIGHUP end the tests under way and restore the file; SIGKILL cannot be caught, so each mutation's
line names the command that restores its file before the file is touched, and the next start names any file
a killed run left broken.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    original: str
    broken: str
    tests: tuple[str, ...]  # pytest node ids or files, with -k expressions after "::-k "


MUTATIONS = [
    Mutation("per-process reseed dropped (every process draws the same dropout masks)",
             "accel_train/training/setup.py", "set_seed(config.seed, device_specific=True)", "set_seed(config.seed)",
             ("tests/checkpoints/test_checkpoints_stops_and_exact_resume.py::test_dropout_draws_differ_per_process",)),
    Mutation("split_batches off (batch_size per process instead of global)",
             "accel_train/distributed/accelerator.py", "split_batches=True", "split_batches=False",
             ("tests/contracts/test_same_training_at_any_world_size.py::test_n_processes_with_batch_b_end_with_the_weights_of_one_process_with_batch_nb",)),
    Mutation("skip_first_batches skipped (a resumed epoch starts from its first batch)",
             "accel_train/training/steps.py",
             "micro_batches = self.accelerator.skip_first_batches(self.loader, micro_batches_done)",
             "micro_batches = self.loader",
             ("tests/checkpoints/test_checkpoints_stops_and_exact_resume.py::test_resume_path_continues_from_that_checkpoint_of_its_own_folder_as_if_never_interrupted",)),
    Mutation("gather instead of gather_for_metrics (eval counts the last batch's padding)",
             "accel_train/training/evaluation.py", "accelerator.gather_for_metrics(outputs)",
             "accelerator.gather(outputs)",
             ("tests/distributed/test_exact_eval_at_any_world_size_and_world_size_checks.py::test_eval_is_exact_at_any_world_size",)),
    Mutation("checkpoint metadata written before the files (published, then saved into)",
             "accel_train/run/checkpoint.py", "                self.snapshots.write(snapshot, partial)\n",
             "                if accelerator.is_main_process:\n"
             "                    existing = list_checkpoints(self.directory)\n"
             "                    self.place.commit(name, partial, manifest(progress, evaluated, {}, "
             "existing[-1][1][\"serial\"] + 1 if existing else 1, accelerator.num_processes, self.config.to_dict()))\n"
             "                self.snapshots.write(snapshot, partial)\n",
             ("tests/checkpoints/test_checkpoints_stops_and_exact_resume.py::test_resume_path_continues_from_that_checkpoint_of_its_own_folder_as_if_never_interrupted",
              "tests/checkpoints/test_checkpoints_stops_and_exact_resume.py::test_a_save_cut_short_is_ignored_with_a_warning_then_removed_by_the_next_save")),
    Mutation("a checkpoint's manifest written before its objects are uploaded",
             "accel_train/run/checkpoint.py",
             "            self.place.put_part(name, partial, accelerator.process_index)\n",
             "            if accelerator.is_main_process:\n"
             "                from accel_train.run.place import files_in, sha256_of\n"
             "                existing = list_checkpoints(self.directory)\n"
             "                self.place.commit(name, partial, manifest(progress, evaluated, "
             "{path.name: [path.stat().st_size, sha256_of(path)] for path in files_in(partial)}, "
             "existing[-1][1][\"serial\"] + 1 if existing else 1, "
             "accelerator.num_processes, self.config.to_dict()))\n"
             "            self.place.put_part(name, partial, accelerator.process_index)\n",
             ("tests/run_folder/test_run_folder_in_object_storage.py::test_kill_9_during_an_upload_leaves_a_partial_checkpoint_the_next_start_ignores_saying_so",)),
    Mutation("retention makes room before a save (the checkpoint a start resumed from deleted before a newer one is "
             "committed, as Lightning #21813)",
             "accel_train/run/checkpoint.py", "        hooks.every().checkpoint_saving(progress)\n",
             "        hooks.every().checkpoint_saving(progress)\n"
             "        if self.accelerator.is_main_process:\n"
             "            for old in list_checkpoints(self.directory)[:len(list_checkpoints(self.directory)) + 1 - "
             "self.cfg.keep_last]:\n"
             "                self.place.remove(*old)\n",
             ("tests/run_folder/test_run_folder_in_object_storage.py::test_retention_keeps_the_checkpoint_a_start_resumed_from_until_a_newer_one_is_committed_and_nothing_else_is_touched",)),
    Mutation("a buffer reused while its writer still reads it (a checkpoint mixes two steps)",
             "accel_train/run/snapshot.py", "        buffers = self.free_sets.get_nowait()\n",
             "        buffers = self.free_sets.get_nowait()\n"
             "        self.free_sets.put(buffers)\n",
             ("tests/checkpoints/test_a_slow_save_never_mixes_two_steps.py::test_a_checkpoint_whose_write_outlasts_upload_wait_s_holds_its_own_step_though_the_next_save_came_meanwhile",)),
    Mutation("a save deletes the partial folder of a save still under way (that checkpoint is lost)",
             "accel_train/run/place.py", "            if stale.name.removeprefix(PARTIAL_PREFIX) not in under_way:",
             "            if True:",
             ("tests/checkpoints/test_a_slow_save_never_mixes_two_steps.py::test_a_checkpoint_whose_upload_outlasts_upload_wait_s_is_committed_though_training_saved_again_meanwhile",)),
    Mutation("the end of a run does not wait for its uploads (the background thread dies with the process)",
             "accel_train/run/place.py", "            self.submit(lambda: None).result(timeout=seconds)\n",
             "            self.submit(lambda: None)\n",
             ("tests/run_folder/test_run_folder_in_object_storage.py::test_the_end_of_a_run_waits_for_its_last_upload",)),
    Mutation("SIGTERM ignored (not handled: the process dies without saving)",
             "accel_train/distributed/signals.py", "HANDLED = (signal.SIGTERM, signal.SIGINT)",
             "HANDLED = (signal.SIGINT,)",
             ("tests/checkpoints/test_checkpoints_stops_and_exact_resume.py::-k single_process",)),
    Mutation("stop signal decided without the all-reduce (each process decides alone)",
             "accel_train/distributed/signals.py",
             "work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=cpu_group(self.timeout_s), async_op=not now)",
             "work = torch.futures.Future()\n        work.set_result(None)",
             ("tests/checkpoints/test_checkpoints_stops_and_exact_resume.py::test_a_second_signal_during_the_save_does_not_cut_the_checkpoint_short",)),
    Mutation("processes agree on a stop signal only after evaluations (a store-backed run stopped 10 steps late)",
             "accel_train/distributed/signals.py",
             "            return self.received is not None\n",
             "            return self.received is not None\n        if not now:\n            return False\n",
             ("tests/run_folder/test_run_folder_in_object_storage.py::-k sigterm_stops and bucket",)),
    Mutation("the watchdog of a run in a store looks for the other processes in its own staging folder",
             "accel_train/training/setup.py", "place.store_of(STUCK_DIR))",
             "None)",
             ("tests/distributed/test_a_stuck_process_is_named.py::-k bucket",)),
    Mutation("resume download made per process again (8 processes of a node read a checkpoint 8 times)",
             "accel_train/run/place.py",
             "self.download(fetched, folder.name, meta) if accelerator.is_local_main_process else None\n",
             "self.download(fetched / str(accelerator.process_index), folder.name, meta)\n"
             "        fetched = fetched / str(accelerator.process_index)\n",
             ("tests/run_folder/test_run_folder_in_object_storage.py::-k reading_its_checkpoint_once",)),
    Mutation("a part with tensors (the EMA) left out of the background save",
             "accel_train/run/checkpoint.py", "            prepared.parts.update(self.tensor_parts)\n",
             "            pass\n",
             ("tests/checkpoints/test_a_slow_save_never_mixes_two_steps.py::-k same_contents",)),
    Mutation("the background save names the weights as DDP wraps them (module.*), not as save_state does",
             "accel_train/run/snapshot.py",
             "accelerator.get_state_dict(accelerator.unwrap_model(model, keep_fp32_wrapper=True,",
             "accelerator.get_state_dict((lambda model, **_: model)(model, keep_fp32_wrapper=True,",
             ("tests/training/test_regularisation_and_model_selection.py::test_early_stopping_stops_every_process_at_the_same_step_and_saves_the_final_checkpoint",)),
    Mutation("a data.cache_dir that is a file reaches the first read of a block (a traceback in a worker)",
             "accel_train/data/shards/dataset.py", "    if existing is not None and not existing.is_dir():",
             "    if False:",
             ("tests/errors/test_bad_inputs_are_one_line_and_lose_nothing.py::-k cache_dir",)),
    Mutation("a shard deleted from the store is found at its first read only (no listing at the start)",
             "accel_train/data/shards/dataset.py", "    _refuse_missing_shards(store, split, index)\n", "",
             ("tests/data/test_shards_in_object_storage.py::-k deleted",)),
    Mutation("a shard deleted while the run trains ends it with a traceback",
             "accel_train/data/shards/cache.py", "            except FileNotFoundError:\n                raise",
             "            except KeyError:\n                raise",
             ("tests/data/test_shards_in_object_storage.py::-k deleted and trains",)),
    Mutation("a run in a store refused after its start keeps its staging folder",
             "accel_train/run/folder.py", "        place.discard()\n", "        pass\n",
             ("tests/run_folder/test_run_folder_in_object_storage.py::-k leaves_no_staging",)),
    Mutation("a refusal of a store run names the staging folder, not the URL the user typed",
             "accel_train/run/resume.py",
             "refuse_other_identity(place.shown(found[-1][0]), found[-1][1], config)",
             "refuse_other_identity(str(found[-1][0]), found[-1][1], config)",
             ("tests/run_folder/test_run_folder_in_object_storage.py::-k leaves_no_staging",)),
    Mutation("the run folder's own patience key ignored (a store run folder retries for the data's)",
             "accel_train/run/place.py",
             "    return config.checkpoint.store_patience_s or config.data.store_patience_s\n",
             "    return config.data.store_patience_s\n",
             ("tests/run_folder/test_run_folder_in_object_storage.py::-k patience",)),
    Mutation("scheduler stepped twice per optimizer step",
             "accel_train/training/loop.py", "                run.scheduler.step(skipped)",
             "                run.scheduler.step(skipped)\n                run.scheduler.step(skipped)",
             ("tests/contracts/test_same_training_at_any_world_size.py::test_learning_rate_at_every_step_is_the_same_at_1_2_and_3_processes",)),
    Mutation("world-size guard dropped (N processes that formed no group run alone)",
             "accel_train/distributed/accelerator.py",
             "if launcher.world_size is not None and launcher.world_size != accelerator.num_processes:", "if False:",
             ("tests/distributed/test_exact_eval_at_any_world_size_and_world_size_checks.py::test_a_launch_that_forms_no_process_group_exits_4_instead_of_evaluating_alone",)),
    Mutation("train line not averaged over processes (process 0's loss only)",
             "accel_train/training/meter.py", "every[:, :-1].mean(0)", "every[0, :-1]",
             ("tests/checkpoints/test_checkpoints_stops_and_exact_resume.py::test_a_train_line_averages_the_loss_over_its_steps_and_over_the_processes",)),
    Mutation("a non-finite step still updates the weights (on_nonfinite=skip)",
             "accel_train/training/guard.py", "self._apply(optimizer, skipped)",
             "self._apply(optimizer, torch.zeros_like(skipped))",
             ("tests/training/test_nonfinite_guard.py::test_on_nonfinite_skip_leaves_the_weights_of_the_skipped_step_untouched_and_trains_on",)),
    Mutation("no checkpoint saved on a stop signal",
             "accel_train/training/loop.py",
             "                if stopping or run.checkpoints.due(progress, last=stop_early or progress.finished):\n",
             '                saved = "nowhere"\n'
             "                if run.checkpoints.due(progress, last=stop_early or progress.finished):\n",
             ("tests/checkpoints/test_checkpoints_stops_and_exact_resume.py::-k single_process",)),
    Mutation("a second signal cuts the save short (Python's Ctrl-C comes back after the first)",
             "accel_train/distributed/signals.py", "            self.received = signal.Signals(signum).name\n",
             "            self.received = signal.Signals(signum).name\n"
             "            signal.signal(signal.SIGINT, signal.default_int_handler)\n",
             ("tests/checkpoints/test_checkpoints_stops_and_exact_resume.py::test_a_second_signal_during_the_save_does_not_cut_the_checkpoint_short",)),
    Mutation("VAE prior samples drawn from the global RNG (a different grid each evaluation)",
             "accel_train/workloads/tasks/vae.py", ", generator=torch.Generator().manual_seed(self.seed))", ")",
             ("tests/workloads/test_vae.py::test_prior_samples_decode_the_same_draws_at_every_evaluation_whatever_the_global_rng",)),
    Mutation("train.compile ignored",
             "accel_train/workloads/models.py", "        model.compile()\n", "        pass\n",
             ("tests/training/test_compile_and_channels_last_change_speed_only.py",)),
    Mutation("train.collective_timeout_s not passed to the process group (torch's default applies)",
             "accel_train/distributed/accelerator.py",
             "kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=collective_timeout_s))],",
             "kwargs_handlers=[],",
             ("tests/checkpoints/test_checkpoints_stops_and_exact_resume.py::test_a_hung_process_fails_the_others_at_collective_timeout_s",)),
    Mutation("a resume at another world size ignores the position in the epoch (starts the epoch over)",
             "accel_train/run/resume.py", "epoch, done = resume_position(meta)",
             'epoch, done = resume_position(meta) if meta["world_size"] == accelerator.num_processes else '
             '(meta["epoch"], 0)',
             ("tests/contracts/test_resume_at_another_world_size.py::test_a_resume_at_another_world_size_trains_the_same_global_batches_at_the_same_lr",)),
    Mutation("seedable sampler off (data order no longer a function of seed and epoch alone)",
             "accel_train/distributed/accelerator.py", "use_seedable_sampler=True", "use_seedable_sampler=False",
             ("tests/contracts/test_same_training_at_any_world_size.py::test_shuffling_is_a_function_of_seed_and_epoch",
              "tests/contracts/test_same_training_at_any_world_size.py::test_shuffling_is_the_same_at_any_world_size_and_differs_between_epochs")),
    Mutation("doctor takes whatever accepts a connection on the main port for machine 0's rendezvous",
             "accel_train/launch/doctor.py", "why = store_answers(address, port, timeout)", "why = None",
             ("tests/launching/test_doctor.py::test_doctor_on_a_worker_node_does_not_take_whatever_accepts_connections_for_the_main_nodes_rendezvous",)),
    Mutation("eval and resume take any setting, whatever the run was trained with",
             "accel_train/config/compatibility.py", "    found = contradictions(recorded, config)\n",
             "    found = []\n",
             ("tests/run_folder/test_eval_predict_and_resume_read_the_run_folder.py::test_a_setting_that_contradicts_the_run_is_refused_naming_the_key_and_both_values",)),
    Mutation("the checkpoint line printed over the progress bar",
             "accel_train/run/checkpoint.py", 'logger.info(f"checkpoint step', 'print(f"checkpoint step',
             ("tests/run_folder/test_watching_a_run.py::test_the_demo_in_a_terminal_shows_no_warning_and_an_unbroken_bar",)),
    # guard.py, NonFiniteGuard.step: the flag of this process's terms reduced (max) over every process. A NaN loss
    # reaches the gradients, whose all-reduce spreads it anyway; a non-finite loss value whose gradients stay
    # finite does not, so without the reduction only the process that saw it skips and stops.
    Mutation("the non-finite guard decides per process (its cross-process reduction removed)",
             "accel_train/training/guard.py",
             'self.accelerator.reduce(flags, reduction="max").unbind()', "flags.unbind()",
             ("tests/training/test_nonfinite_guard.py::test_a_nonfinite_loss_on_one_process_with_finite_gradients_stops_every_process_at_that_step",)),
    # loop.py, save(): the guard's host read before a checkpoint. The stop tests that log every step stop at the
    # train line first; with the non-finite step between train lines, this check alone keeps it out of a save.
    Mutation("no guard check before a save (a checkpoint written past a non-finite step)",
             "accel_train/training/loop.py",
             "run.guard.check(run.progress)  # never save past a non-finite step (stop policy)", "pass",
             ("tests/training/test_nonfinite_guard.py::test_a_nonfinite_step_between_train_lines_stops_the_run_before_the_next_checkpoint_or_evaluation",)),
    # loop.py, validate(): the same check before an evaluation (its metrics line, model selection, early stop).
    Mutation("no guard check before an evaluation (metrics of a step past a non-finite one)",
             "accel_train/training/loop.py",
             "run.guard.check(run.progress)  # nothing is evaluated past a non-finite step", "pass",
             ("tests/training/test_nonfinite_guard.py::test_a_nonfinite_step_between_train_lines_stops_the_run_before_the_next_checkpoint_or_evaluation",)),
    # ema.py, WeightsEMA.update: the average taken after each optimizer step (the first copies the weights).
    Mutation("the EMA update skipped (model_ema keeps the initial weights)",
             "accel_train/training/ema.py", "self.averaged.update_parameters(self.accelerator.unwrap_model(model))",
             "pass",
             ("tests/training/test_regularisation_and_model_selection.py::test_the_ema_is_the_decayed_average_of_the_weights_and_loads_into_the_plain_model",)),
    # setup.py: the micro-steps per optimizer step that Accelerate's accumulate() counts (sync, all-reduce, step)
    # and divides the loss by, one more than the micro-batches the loader cuts a step's batch into.
    Mutation("the accumulation boundary off by one (an optimizer step every accumulation + 1 micro-batches)",
             "accel_train/training/preparation.py", "accelerator.gradient_accumulation_steps = accumulation",
             "accelerator.gradient_accumulation_steps = accumulation + 1",
             ("tests/contracts/test_accumulation_trains_like_one_global_batch.py::test_accumulation_trains_like_one_batch_of_the_same_global_size",)),
    # data/validation.py, hold_out_validation: the training set is what is left after the held-out samples.
    Mutation("the validation split overlapping the training set (held-out samples trained on)",
             "accel_train/data/validation.py",
             "held, kept = order[:count].sort().values, order[count:].sort().values",
             "held, kept = order[:count].sort().values, order.sort().values",
             ("tests/training/test_regularisation_and_model_selection.py::test_the_validation_split_is_drawn_by_seed_disjoint_from_training_and_evaluated_unaugmented",)),
    # prediction.py, predict: the gathered index says which file a row belongs to.
    Mutation("predict rows attached to the wrong files (each file gets its neighbour's row)",
             "accel_train/training/prediction.py", "found[index] = (labels, scores)",
             "found[(index + 1) % len(files)] = (labels, scores)",
             ("tests/workloads/test_user_code_python_api_and_predict.py::test_predict_gives_each_file_the_models_own_labels_and_scores_for_that_file",)),
    # data/keyed.py, sample_keys: the epoch in the key of a sample's crop and flip.
    Mutation("the augmentation key ignores the epoch (sample_keys)",
             "accel_train/data/keyed.py", "offset = ((seed * 1_000_003 + epoch + 1) * 0x5851F42D4C957F2D) % 2**64",
             "offset = ((seed * 1_000_003 + 1) * 0x5851F42D4C957F2D) % 2**64",
             ("tests/data/test_data_paths_and_keyed_augmentation.py::test_a_samples_crop_and_flip_depend_on_seed_epoch_and_index_only",
              "tests/data/test_data_paths_and_keyed_augmentation.py::test_every_epoch_crops_and_flips_each_sample_anew_at_any_world_size")),
    # data/loaders.py, start_epoch: the loop hands the on-device dataset the epoch its keys use (Accelerate's set_epoch
    # reaches only the seedable sampler).
    Mutation("the augmentation key ignores the epoch (the loop never hands the epoch to the on-device dataset)",
             "accel_train/data/loaders.py", "loader.dataset.set_epoch(epoch, seed)",
             "loader.dataset.set_epoch(0, seed)",
             ("tests/data/test_data_paths_and_keyed_augmentation.py::test_every_epoch_crops_and_flips_each_sample_anew_at_any_world_size",)),
    # data/keyed.py, KeyedSamples: the epoch in the key that seeds each sample's transforms wherever a DataLoader serves
    # samples one by one (ImageFolder, data.on_device=false, a user's dataset); sample_keys itself stays whole.
    Mutation("the per-sample key ignores the epoch (per-sample transforms: KeyedSamples)",
             "accel_train/data/keyed.py", "keys = sample_keys(torch.as_tensor(indices), epoch, seed).tolist()",
             "keys = sample_keys(torch.as_tensor(indices), 0, seed).tolist()",
             ("tests/data/test_data_paths_and_keyed_augmentation.py::test_per_sample_transforms_draw_anew_for_another_seed_and_another_epoch",)),
    # run/folder.py, RunFolder: each start's world size, which is how an elastic job's loss of a machine shows.
    Mutation("starts.jsonl records no world size (a job that lost a machine looks like one that did not)",
             "accel_train/run/folder.py", '"world_size": state.launch["world_size"], ', "",
             ("tests/launching/test_elastic_jobs_lose_and_gain_machines.py::test_a_job_that_loses_a_machine_restarts_without_it_from_the_newest_checkpoint_and_"
              "finishes[killed]",)),
    # distributed/watchdog.py, Watchdog._watch: the bound that makes every process dump its stacks and the main one
    # name the stopped process; without it the others wait in their collective until train.collective_timeout_s.
    Mutation("a stuck process is never named (the watchdog never fires)",
             "accel_train/distributed/watchdog.py", "            if idle > self.bound:", "            if False:",
             ("tests/distributed/test_a_stuck_process_is_named.py::test_a_blocked_worker_is_named_with_its_host_step_and_function_and_the_restarted_"
              "run_resumes",
              "tests/distributed/test_a_stuck_process_is_named.py::test_a_single_process_that_stops_names_itself_and_ends_with_exit_6")),
    # launch/settings.py, add_arguments: accelerate launch takes one number of machines; a range asks for torchrun.
    Mutation("accel-train launch takes a range of machines (argparse's usage instead of the elastic command)",
             "accel_train/launch/settings.py", 'parser.add_argument("--num_machines", type=machine_count)',
             'parser.add_argument("--num_machines", type=int)',
             ("tests/launching/test_multi_machine_start.py::test_accel_train_launch_refuses_a_range_of_machines_in_one_line_naming_"
              "the_elastic_torchrun_command",)),
    # meter.py, timed: the wait for each batch is what data_wait reports.
    Mutation("the wait for a batch not counted (data_wait always 0, no warning for a slow input)",
             "accel_train/training/meter.py", "self.waited += self.clock() - asked", "pass",
             ("tests/training/test_step_boundaries.py::-k data_wait or waits_for_data",)),
    # layout.py, read_jsonl: only a last line cut short is skipped; a damaged one before others is named.
    Mutation("a damaged metrics.jsonl line in the middle skipped silently",
             "accel_train/run/layout.py", "if any(later.strip() for later in texts[number:]):", "if False:",
             ("tests/run_folder/test_watching_a_run.py::-k damaged",)),
    # run/display.py, leaving_room_for_an_echo: the terminal's "^C" echo must fit beside the bar.
    Mutation("a bar as wide as the terminal (Ctrl-C's echo wraps and leaves a stale bar)",
             "accel_train/run/display.py", "return (max(1, columns - 2) if columns else columns), rows",
             "return columns, rows", ("tests/run_folder/test_watching_a_run.py::-k ctrl_c",)),
    # loop.py: the observers close however training ends, so a stop line starts a line of its own.
    Mutation("the bar left open when a signal stops the run (the stop line starts at the bar's end)",
             "accel_train/training/loop.py", "run.observers as observers, run.watchdog:\n",
             "run.watchdog:\n        observers = run.observers\n",
             ("tests/run_folder/test_watching_a_run.py::-k ctrl_c",)),
    # distributed/collectives.py, processes_where: with micro_batch_size=auto, whether any process ran out of memory
    # in a step, agreed over the CPU group. Without it the process that ran out halves its micro-batch alone: the
    # others never learn of it, so no warning, no record, and the checkpoint keeps the micro-batch that ran out.
    Mutation("processes do not agree that one ran out of memory (micro_batch_size=auto: it halves alone)",
             "accel_train/distributed/collectives.py",
             "dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=cpu_group(timeout_s))", "pass",
             ("tests/training/test_out_of_memory_halves_the_micro_batch_on_every_process.py::test_one_process_running_out_makes_every_process_redo_the_step_with_half_"
              "the_micro_batch",)),
    # sweep/runner.py, report: a trial the pruner rejects is sent SIGTERM, so it saves and exits 75.
    Mutation("a pruned trial is not stopped (it trains to the end, only recorded as pruned)",
             "accel_train/sweep/runner.py",
             "                \"stopping it\")\n    process.stop()\n", "                \"stopping it\")\n",
             ("tests/tools/test_sweep.py::-k six_trial",)),
    # sweep/trial.py, _dies_with_the_sweep: a killed sweep's trial gets SIGTERM and saves, so the rerun resumes it.
    Mutation("a killed sweep leaves its trial training alone (no SIGTERM from the kernel)",
             "accel_train/sweep/trial.py", "ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)",
             "pass", ("tests/tools/test_sweep.py::-k killed",)),
    # sweep/study.py, new_trial: the sampler is seeded from (seed, trial number).
    Mutation("the sampler not seeded (the same seed samples other values)",
             "accel_train/sweep/study.py", "TPESampler(seed=trial_seed(seed, len(study.trials)),",
             "TPESampler(seed=None,", ("tests/tools/test_sweep.py::-k same_seed_samples",)),
    # config/recipes.py: train.lr_base computes train.lr from the global batch.
    Mutation("train.lr_base ignored (train.lr stays the recipe's at any batch size)",
             "accel_train/config/recipes.py", "    _resolve_lr(config.train, lr_given=",
             "    (lambda *a, **k: None)(config.train, lr_given=",
             ("tests/config/test_config_and_command_line.py::-k lr_base",)),
    # data/shards/order.py, epoch_order: the shards are permuted anew each epoch, from (seed, epoch).
    Mutation("the shard order ignores the epoch (every epoch reads the shards in epoch 0's order)",
             "accel_train/data/shards/order.py", "np.random.SeedSequence([seed, epoch, _ORDER_TAG])",
             "np.random.SeedSequence([seed, 0, _ORDER_TAG])",
             ("tests/data/test_shard_order_and_read_plan.py::-k same_seed_and_epoch",)),
    # data/shards/cache.py, BlockCache.fetch: a block is cached by the sha256 its index lists, so a shard rewritten
    # at the same URL is never served from an old copy.
    Mutation("the block cache keyed by shard name and block number, not the index's sha256",
             "accel_train/data/shards/cache.py", "        path = self.block_path(sha256)\n",
             "        path = self.block_path(hashlib.sha256(f\"{folder}/{shard.name}/{block}\".encode())"
             ".hexdigest())\n",
             ("tests/data/test_shard_format_cache_and_store.py::-k rewritten",)),
    # data/shards/cache.py, BlockCache.fetch: a block's bytes are checked (length and sha256) before they are kept.
    Mutation("a retry returns the truncated body (a block's bytes kept unchecked)",
             "accel_train/data/shards/cache.py", "start, end, check=wrong, size=shard.bytes)",
             "start, end, check=None, size=shard.bytes)",
             ("tests/data/test_shard_blocks_are_checked_before_use.py",)),
    Mutation("batches copied to the GPU with blocking copies (each waits for every kernel queued before it)",
             "accel_train/distributed/accelerator.py",
             "data_seed=seed,\n                                                  non_blocking=True),",
             "data_seed=seed),",
             ("tests/training/test_step_boundaries.py::test_batches_for_a_gpu_come_from_pinned_memory_and_reach_it_without_blocking",)),
    Mutation("the EMA's counter on the CPU (copied to the device at every update)",
             "accel_train/training/ema.py", "super().__init__(model, device=device, use_buffers=True,",
             "super().__init__(model, use_buffers=True,",
             ("tests/training/test_step_boundaries.py::test_the_weights_average_lives_on_the_models_device_and_updates_without_moving_anything",)),
    Mutation("the EMA updated by AveragedModel's own update (its counter read on the host at every step)",
             "accel_train/training/ema.py",
             "        self.averaged.update_parameters(self.accelerator.unwrap_model(model))",
             "        AveragedModel.update_parameters(self.averaged, self.accelerator.unwrap_model(model))",
             ("tests/training/test_step_boundaries.py::-k reads_nothing and ema",)),
    Mutation("a skipped fp16 step advances the LR schedule",
             "accel_train/training/loop.py", "                run.scheduler.step(skipped)",
             "                run.scheduler.step()",
             ("tests/training/test_fp16_loss_scaling.py::test_a_step_whose_fp16_gradients_overflow_is_skipped_counted_and_leaves_weights_and_lr_where_they_were",)),
    Mutation("an fp16 step with a non-finite loss but finite gradients applied (the scaler's flag alone decides)",
             "accel_train/training/guard.py", "        bad = skipped if self.scaler is None else loss_bad\n",
             "        bad = skipped if self.scaler is None else loss_bad\n"
             "        skipped = skipped if self.scaler is None else grads_bad\n",
             ("tests/training/test_fp16_loss_scaling.py::test_a_nonfinite_fp16_loss_with_finite_gradients_is_not_applied",)),
    Mutation("an fp16 loss scale that collapses goes on halving (every step skipped, silently)",
             "accel_train/training/guard.py", "            self._check_loss_scale(step, longest_run, run_start)",
             "            pass",
             ("tests/training/test_fp16_loss_scaling.py::test_fp16_gradients_that_overflow_at_every_scale_stop_every_process_in_one_line",)),
    Mutation("model.sync_batchnorm with micro_batch_size=auto accepted (a process out of memory inside SyncBN's "
             "collective leaves the others waiting)",
             "accel_train/config/schema.py",
             'if config.model.sync_batchnorm and config.train.micro_batch_size == "auto":', "if False:",
             ("tests/config/test_config_and_command_line.py::-k cannot_hold_together",)),
    Mutation("predict's last batch not padded (a file meets another batch shape at another world size)",
             "accel_train/training/prediction.py", "self.length = -(-len(files) // global_batch) * global_batch",
             "self.length = len(files)",
             ("tests/workloads/test_user_code_python_api_and_predict.py::test_predict_runs_every_file_in_a_full_batch_so_its_scores_do_not_depend_on_the_world_size",)),
    Mutation("doctor checks gloo's addressing on CPU nodes only (a GPU node's side group unchecked)",
             "accel_train/launch/doctor.py",
             'if not launch.socket_interfaces.get("GLOO_SOCKET_IFNAME") and not address.startswith("127."):',
             'if device == "cpu" and not launch.socket_interfaces.get("GLOO_SOCKET_IFNAME") and '
             'not address.startswith("127."):',
             ("tests/launching/test_doctor.py::-k loopback",)),
    Mutation("train.deterministic leaves cuDNN's autotuning on",
             "accel_train/distributed/devices.py", "torch.backends.cudnn.benchmark = not deterministic",
             "torch.backends.cudnn.benchmark = True",
             ("tests/training/test_compile_and_channels_last_change_speed_only.py::-k deterministic",)),
    # tools/bench_saves.py, first_step: on a GPU the prepared model is there, and so must its inputs be.
    Mutation("bench --saves inputs on the CPU whatever the model's device",
             "accel_train/tools/bench_saves.py", "    device = next(model.parameters()).device\n",
             "    device = torch.device(\"cpu\")\n",
             ("tests/tools/test_bench.py::test_bench_saves_steps_the_model_where_prepare_put_it",)),
    # tools/bench.py, plain_loop: the reference's inputs are resized to data.image_size, as our loop's are.
    Mutation("bench's plain loop at the images' stored size, not data.image_size",
             "accel_train/tools/bench.py", "to_model_input(images[index], data.dataset.size, mean, std)",
             "to_model_input(images[index], None, mean, std)",
             ("tests/tools/test_bench.py::-k recipes_image_size",)),
    Mutation("FSDP2's gradient norm left a DTensor (the non-finite guard's all-reduce fails on it)",
             "accel_train/training/guard.py",
             '    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm', "    return norm",
             ("tests/contracts/test_fsdp_trains_and_resumes_like_one_plain_process.py::test_two_fsdp_processes_train_like_one_plain_process",)),
    # data/decode.py: images made into floats on the host (random erasing runs there) pass the device's finish as they
    # are; without that check they are scaled and normalised twice
    Mutation("ImageFolder's images normalised twice (on the host, then again on the device)",
             "accel_train/data/decode.py", "        if images.dtype != torch.uint8:\n            return images\n", "",
             ("tests/data/test_images_decoded_to_tensors.py",)),
    # distributed/devices.py: where the data's finish runs is chosen from the device the run trains on
    Mutation("the finish run in the workers on a GPU too (the host normalising what the device would)",
             "accel_train/distributed/devices.py", 'return torch.device(device).type == "cpu" and workers > 0',
             "return workers > 0",
             ("tests/data/test_the_finish_runs_where_the_run_trains.py::test_on_a_gpu_or_any_device_but_the_cpu_the_device_finishes_what_the_workers_load",)),
    Mutation("a CPU run's workers never finishing its batches (the main process does, beside the model)",
             "accel_train/distributed/devices.py", 'return torch.device(device).type == "cpu" and workers > 0',
             "return False",
             ("tests/data/test_the_finish_runs_where_the_run_trains.py::test_a_cpu_run_with_workers_gets_finished_batches_from_its_loader_and_the_main_process_never_finishes",)),
    Mutation("data.num_workers=auto's measurement leaving BatchNorm's statistics as its micro-steps moved them",
             "accel_train/training/feeding.py", "                value.copy_(buffers[name])", "                pass",
             ("tests/training/test_workers_chosen_by_measurement.py::test_the_measurement_leaves_the_run_as_a_given_number_of_workers_trains_it",)),
    Mutation("shards read one sample at a time where no transform draws (ShardSamples.__getitems__ unused)",
             "accel_train/data/keyed.py",
             "    return list(fetch(indices)) if fetch is not None else [samples[index] for index in indices]",
             "    return [samples[index] for index in indices]",
             ("tests/data/test_data_paths_and_keyed_augmentation.py::-k batch_at_a_time",)),
    Mutation("decoded images cropped and flipped from the worker's own random stream, not their sample's key",
             "accel_train/data/keyed.py", "                seed_generators(key, self.draws_from)\n",
             "                pass\n",
             ("tests/data/test_data_paths_and_keyed_augmentation.py::test_per_sample_transforms_draw_alike_at_1_and_2_processes_0_and_2_workers_and_after_a_resume[imagefolder_tree_augmented]",)),
    Mutation("augmented shards said to draw nothing (their samples cropped from the worker's stream, unkeyed)",
             "accel_train/data/shards/dataset.py", 'augment_draws(index.transforms != "as_written" and augments(',
             'augment_draws(False and augments(',
             ("tests/data/test_data_paths_and_keyed_augmentation.py::test_per_sample_transforms_draw_alike_at_1_and_2_processes_0_and_2_workers_and_after_a_resume[raw_pixel_shards_of_that_tree]",)),
    Mutation("shrunk shards written with a resize other than the evaluation transform's (no antialiasing)",
             "accel_train/data/decode.py", "functional.resize(pixels, short_side, antialias=True)",
             "functional.resize(pixels, short_side, antialias=False)",
             ("tests/data/test_shards_made_to_be_read_fast.py::test_evaluation_from_raw_pixel_shards_shrunk_to_its_resize_equals_evaluation_on_the_tree",)),
    Mutation("predict of a run from shrunk shards not shrinking the file first",
             "accel_train/data/shards/dataset.py", "        if index.shrink_to:  # and shrunk as they were written",
             "        if False:",
             ("tests/data/test_shards_made_to_be_read_fast.py::test_predict_of_a_file_shrinks_it_as_its_shard_was_shrunk",)),
    Mutation("augmented raw shards of the registry never cropped on the device (the keys the batches carry ignored)",
             "accel_train/data/in_memory.py",
             "            return self.images(random_crop_flip(images, pad_for(images.shape[-1]), keys)), labels",
             "            return self.images(images), labels",
             ("tests/data/test_shards_made_to_be_read_fast.py::test_augmented_raw_pixel_shards_of_the_registry_are_cropped_on_the_device_as_the_in_memory_data_is",)),
    Mutation("samples held out of augmented shards for validation cropped and flipped as training samples",
             "accel_train/data/validation.py",
             "            setattr(copied, name, value)", "            pass",
             ("tests/data/test_shards_made_to_be_read_fast.py::test_augmented_raw_pixel_shards_of_the_registry_are_cropped_on_the_device_as_the_in_memory_data_is",)),
    Mutation("random crops of raw photographs never flipped (RandomHorizontalFlip's draw ignored on the host)",
             "accel_train/data/imagefolder.py",
             "return region.flip(-1) if torch.rand(1) < 0.5 else region.clone()", "return region.clone()",
             ("tests/data/test_shards_made_to_be_read_fast.py::test_random_crops_of_raw_photographs_are_cut_on_the_host_and_resized_on_the_device_as_the_host_would",)),
    Mutation("crops of raw photographs resized on the device without the host's antialiasing",
             "accel_train/data/decode.py",
             "functional.resize(crop, [size, size], interpolation=mode, antialias=True)",
             "functional.resize(crop, [size, size], interpolation=mode, antialias=False)",
             ("tests/data/test_shards_made_to_be_read_fast.py::test_random_crops_of_raw_photographs_are_cut_on_the_host_and_resized_on_the_device_as_the_host_would",)),
    # data.decode=scaled: the scale that keeps the crop at least the output size, the box at that scale, the draws
    Mutation("a JPEG decoded at a scale that leaves its crop under the output size (upscaled after)",
             "accel_train/data/imagefolder.py", "        if height >= size[0] and width >= size[1]:",
             "        if 2 * height >= size[0] and 2 * width >= size[1]:",
             ("tests/data/test_jpegs_decoded_at_the_scale_the_crop_needs.py",)),
    Mutation("a crop box at a scale one scaled pixel too tall",
             "accel_train/data/imagefolder.py", "_nearest((top + height) / factor) - first_row",
             "_nearest((top + height) / factor) + 1 - first_row",
             ("tests/data/test_jpegs_decoded_at_the_scale_the_crop_needs.py",)),
    Mutation("a draw taken before the crop's from a JPEG's header (the crops and flips of a full decode lost)",
             "accel_train/data/imagefolder.py", "        box = T.RandomResizedCrop.get_params(",
             "        torch.rand(1)\n        box = T.RandomResizedCrop.get_params(",
             ("tests/data/test_jpegs_decoded_at_the_scale_the_crop_needs.py::-k generator",)),
    Mutation("evaluation's JPEG decoded at a scale under its resize's short side (enlarged after)",
             "accel_train/data/imagefolder.py", "for side, least in zip(size, resized))), 1)",
             "for side, least in zip(size, (resized[0] // 2, resized[1])))), 1)",
             ("tests/data/test_jpegs_decoded_at_the_scale_the_crop_needs.py::-k evaluations_scale",)),
    Mutation("a JPEG turned by its EXIF orientation decoded at a scale unturned",
             "accel_train/data/decode.py", " or exif_orientation(data) not in (None, 1)", "",
             ("tests/data/test_jpegs_decoded_at_the_scale_the_crop_needs.py::-k exif",)),
    Mutation("a mistyped URL (s3:/bucket) taken for a local folder named s3:",
             "accel_train/storage.py", "    if not _known_protocol(scheme.lower()):", "    if True:",
             ("tests/errors/test_bad_inputs_are_one_line_and_lose_nothing.py::-k mistyped",)),
    Mutation("predict's output= URL written as a local path (a folder named s3:, the store never written)",
             "accel_train/training/prediction.py", "    if is_remote(str(output)):", "    if False:",
             ("tests/run_folder/test_run_folder_in_object_storage.py::-k eval_predict_runs_plot",)),
    Mutation("model.init_from= a URL read as a local path (no model.safetensors there)",
             "accel_train/run/read_cache.py",
             "    if not is_remote(location):\n        return Path(location)\n    check_location(location, key)",
             "    if True:\n        return Path(location)\n    check_location(location, key)",
             ("tests/run_folder/test_run_folder_in_object_storage.py::-k init_from",)),
    Mutation("a run refused after its output_dir was made leaves the empty folder behind",
             "accel_train/run/folder.py", "                path.rmdir()", "                pass",
             ("tests/errors/test_bad_inputs_are_one_line_and_lose_nothing.py::-k refused_after",)),
    Mutation("shards written onto a file (a traceback of mkdir)",
             "accel_train/data/shards/writer.py", "            if not path.is_dir():", "            if False:",
             ("tests/data/test_writing_shards.py::test_shards_onto_a_file_or_over_a_damaged_record_are_one_line_and_touch_nothing",)),
    Mutation("a damaged index in shard's destination read without a check (a traceback)",
             "accel_train/data/shards/writer.py",
             "    except (ValueError, KeyError, TypeError) as err:  # JSONDecodeError",
             "    except KeyError as err:  #",
             ("tests/data/test_writing_shards.py::test_shards_onto_a_file_or_over_a_damaged_record_are_one_line_and_touch_nothing",)),
    Mutation("shard index replaces the index accel-train shard wrote",
             "accel_train/data/shards/writer.py", '        if held is not None and held.source != "tars":',
             "        if False:",
             ("tests/data/test_writing_shards.py::test_shard_index_never_replaces_the_index_accel_train_shard_wrote_and_refuses_a_tar_cut_short",)),
    Mutation("shard index takes a tar cut short (its last samples silently missing)",
             "accel_train/data/shards/format.py", "    if end + 2 * tarfile.BLOCKSIZE > len(data):", "    if False:",
             ("tests/data/test_writing_shards.py::test_shard_index_never_replaces_the_index_accel_train_shard_wrote_and_refuses_a_tar_cut_short",)),
    Mutation("eval of a URL holding no run names this machine's copy of it, not the URL",
             "accel_train/api.py",
             "    if not (copy.is_file() or (copy / CONFIG_FILE).is_file() or (copy / MODEL_FILE).is_file()):",
             "    if False:", ("tests/run_folder/test_run_folder_in_object_storage.py::-k init_from",)),
    Mutation("plot of one run at a URL draws curves.png into the current folder",
             "accel_train/cli.py", '    beside_url = "output" not in given and',
             '    beside_url = False and "output" not in given and',
             ("tests/run_folder/test_run_folder_in_object_storage.py::-k eval_predict_runs_plot",)),
    Mutation("bench --shards reports a window too short to time (batches made before the clock, read in no time)",
             "accel_train/tools/bench_shards.py", "    if timed < needed:", "    if False:",
             ("tests/tools/test_bench.py::test_bench_shards_refuses_a_window_too_short_to_time_rather_than_report_it",)),
    Mutation("the registry's raw pixels normalised on the device but never resized to data.image_size",
             "accel_train/data/in_memory.py",
             "made = to_model_input(images[None] if one else images, self.size, mean, std)",
             "made = to_model_input(images[None] if one else images, None, mean, std)",
             ("tests/data/test_shards_made_to_be_read_fast.py::test_the_registrys_uint8_pixels_finished_on_the_device_are_the_float_paths_inputs",)),
    Mutation("bench --saves-into and --shards take a mistyped URL (s3:/bucket) for a local folder",
             "accel_train/cli.py",
             "        if location:  # s3:/bucket would become a local folder named \"s3:\"",
             "        if False:",
             ("tests/errors/test_bad_inputs_are_one_line_and_lose_nothing.py::-k mistyped_url and bench",)),
    Mutation("a stopping process restores the default signal handlers before its checkpoint is committed",
             "accel_train/training/loop.py",
             "    with run.signals as signals, run.checkpoints, run.observers as observers, run.watchdog:",
             "    with run.checkpoints, run.signals as signals, run.observers as observers, run.watchdog:",
             ("tests/run_folder/test_run_folder_in_object_storage.py::-k sigterm_stops_a_run_of_2",)),
    Mutation("machine 1 hands over to accelerate launch while machine 0's meeting still listens",
             "accel_train/launch/command.py", "        store.add(f\"{KEY}/left\", 1)\n        deadline",
             "        store.add(f\"{KEY}/left\", 1)\n        return\n        deadline",
             ("tests/launching/test_multi_machine_start.py::test_accel_train_launch_waits_for_a_late_main_machine_saying_so_then_trains_like_one_process",)),
    Mutation("the evaluation split indexed on its own (a class it lacks shifts every label after it)",
             "accel_train/data/classes.py", "    return [position[name] for name in own]",
             "    return list(range(len(own)))",
             ("tests/data/test_labels_matched_by_name.py::test_an_evaluation_folder_lacking_a_class_scores_as_predict_labels_its_files",)),
    Mutation("a registered part (an earlier version's EMA pickle) loaded with weights_only=False",
             "accel_train/run/checkpoint_files.py", 'map_location="cpu", weights_only=True)',
             'map_location="cpu", weights_only=False)',
             ("tests/checkpoints/test_a_checkpoint_runs_no_code_and_damage_never_resumes.py::-k written_before",)),
    Mutation("a checkpoint's files read without checking their sha256 against the manifest",
             "accel_train/run/checkpoint_files.py",
             "if content and hashes.get(name) and sha256_of(path) != hashes[name]:",
             "if False:",
             ("tests/checkpoints/test_a_checkpoint_runs_no_code_and_damage_never_resumes.py::test_a_file_replaced_by_a_pickle_that_runs_code_is_damage_and_the_previous_checkpoint_resumes",)),
    Mutation("random states that do not load resumed silently (as Accelerate's load_state does)",
             "accel_train/run/resume.py", '    if process >= meta["world_size"]:\n        return',
             "    return",
             ("tests/checkpoints/test_a_checkpoint_runs_no_code_and_damage_never_resumes.py::test_a_random_state_file_garbled_at_its_own_size_is_damage_not_a_resume_that_is_no_longer_exact",)),
    Mutation("an hf: dataset's ClassLabel taken by position, not by name (its evaluation split not relabelled)",
             "accel_train/data/hub.py", "    if train:\n        return data\n    return labelled_by(",
             "    if True:\n        return data\n    return labelled_by(",
             ("tests/workloads/test_hub_models_and_datasets.py::test_an_hf_dataset_finds_its_columns_by_type_and_labels_each_split_by_the_names_it_was_written_with",)),
    Mutation("the image processor's mean and std ignored",
             "accel_train/workloads/hf_models.py",
             'mean, std = getattr(processor, "image_mean", None), getattr(processor, "image_std", None)',
             "mean, std = None, None",
             ("tests/workloads/test_hub_models_and_datasets.py::test_the_models_image_processor_gives_the_data_keys_the_user_left_unset",)),
    Mutation("augmentation on an hf: dataset drawn from the worker's own stream (its samples said to draw nothing)",
             "accel_train/data/hub.py", "dataset.draws_from = augment_draws(augments(cfg, train))",
             "dataset.draws_from = augment_draws(False)",
             ("tests/data/test_data_paths_and_keyed_augmentation.py::test_per_sample_transforms_draw_alike_at_1_and_2_processes_0_and_2_workers_and_after_a_resume[hf_dataset_augmented]",)),
    Mutation("a Hub repository's own code run without model.trust_remote_code",
             "accel_train/workloads/hf_models.py",
             '    return {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}',
             '    return {"revision": cfg.revision, "trust_remote_code": True}',
             ("tests/workloads/test_hub_models_and_datasets.py::test_a_repository_with_code_of_its_own_runs_it_only_with_trust_remote_code",)),
    Mutation("keyed dropout's masks drawn from the process's stream (torch.rand), not from the sample keys",
             "accel_train/training/dropout.py",
             "        bits = keyed_bits(keys, self.dropout_keys.step, self.salt, per_sample)",
             "        bits = torch.randint(-2**31, 2**31, (x.shape[0], per_sample), dtype=torch.int32, "
             "device=x.device)",
             ("tests/contracts/test_dropout_keyed_by_sample_trains_alike_everywhere.py::test_dropout_trains_alike_at_any_world_size_micro_batch_and_across_a_resume[ours:mnist_cnn]",)),
    Mutation("a Hub model's pickled weights loaded without model.allow_pickled_weights",
             "accel_train/workloads/hf_models.py", "use_safetensors=None if cfg.allow_pickled_weights else True",
             "use_safetensors=None",
             ("tests/workloads/test_hub_models_and_datasets.py::test_weights_only_in_a_pickle_load_only_when_allowed",)),
    Mutation("the LR schedule stepped by Accelerate's wrapper with the optimizer (a call it does not sync dropped)",
             "accel_train/distributed/accelerator.py", "step_scheduler_with_optimizer=False",
             "step_scheduler_with_optimizer=True",
             ("tests/training/test_step_boundaries.py::test_the_loop_alone_moves_the_lr_schedule_even_on_a_micro_step_accelerate_would_not_sync",)),
    Mutation("pickled weights looked for in a local folder only (a Hub name's cache not asked)",
             "accel_train/workloads/hf_models.py",
             "        return transformers.utils.has_file(repository(cfg), PICKLED, revision=cfg.revision)",
             "        return (Path(repository(cfg)) / PICKLED).is_file()",
             ("tests/workloads/test_hub_models_and_datasets.py::test_hub_names_resolve_from_the_cache_offline_and_a_name_it_lacks_is_one_line_exit_3",)),
    # issue 66: a run folder is data; the code it names runs on the command's word
    Mutation("trust read from a file (a run folder's config.yaml taken for the user's own recipe)",
             "accel_train/config/recipes.py", "    file = RecipeFile(path.resolve(), own=not run, module_folders={",
             "    file = RecipeFile(path.resolve(), own=True, module_folders={",
             ("tests/run_folder/test_a_run_folder_is_data_its_code_runs_on_your_word.py::test_a_run_folder_whose_config_names_os_system_runs_nothing_and_every_command_refuses_it_in_one_line",
              "tests/run_folder/test_a_run_folder_is_data_its_code_runs_on_your_word.py::test_every_key_that_names_code_is_refused_from_a_run_folder_and_a_module_beside_it_never_imported")),
    Mutation("a recipe's folder put on sys.path (files beside it that nobody named become importable)",
             "accel_train/config/recipes.py", "    own_folders = [file.path.parent] if file.own else []\n",
             "    own_folders = [file.path.parent] if file.own else []\n"
             "    __import__(\"sys\").path.append(str(file.path.parent))\n",
             ("tests/run_folder/test_a_run_folder_is_data_its_code_runs_on_your_word.py::test_a_file_named_like_a_module_torch_looks_for_beside_a_recipe_or_a_run_folder_is_never_importable",
              "tests/run_folder/test_a_run_folder_is_data_its_code_runs_on_your_word.py::test_eval_of_a_run_folder_with_opt_einsum_and_pynvml_beside_its_config_imports_neither")),
    Mutation("trust in a Hub repository's code taken from a file",
             "accel_train/config/trust.py", "        if getattr(getattr(config, section), name) and key in origins:",
             "        if False:",
             ("tests/run_folder/test_a_run_folder_is_data_its_code_runs_on_your_word.py::test_trust_in_a_hubs_code_and_in_pickles_comes_from_the_command_never_from_a_file",)),
    Mutation("any code taken for code this user trained or allowed (the record's digest not compared)",
             "accel_train/config/trust.py", "    return digest in _read_record(record_path())",
             "    return True",
             ("tests/run_folder/test_a_run_folder_is_data_its_code_runs_on_your_word.py::test_your_own_run_needs_no_word_and_code_changed_since_or_another_users_needs_it_again",)),
    Mutation("the record's digest blind to the module's content (a changed module taken for the one trained)",
             "accel_train/config/trust.py", "    items = sorted([key, path, str(where.file), where.content_hash()]",
             "    items = sorted([key, path, str(where.file)]",
             ("tests/run_folder/test_a_run_folder_is_data_its_code_runs_on_your_word.py::test_your_own_run_needs_no_word_and_code_changed_since_or_another_users_needs_it_again",)),
    # Issue 66, item 7: commands delete only what they wrote
    Mutation("photos compares its recipe's tuples with photos.json's lists (a folder of the same recipe made again)",
             "accel_train/tools/photos.py", "    recipe = json.loads(json.dumps({", "    recipe = ({",
             ("tests/tools/test_photos.py::test_photos_again_with_the_same_recipe_keeps_the_folder_as_it_is_and_says_so",)),
    Mutation("photos writes over a folder it made that holds a user's file",
             "accel_train/tools/photos.py", "    if recorded is not None:\n        refuse_others_files(root, old)\n",
             "",
             ("tests/tools/test_photos.py::test_a_folder_photos_made_that_holds_a_users_file_is_refused_in_one_line_naming_it_and_left_as_it_is",)),
    Mutation("photos leaves the files of the recipe before behind",
             "accel_train/tools/photos.py", "            remove_with_empty_folders(root, name)", "            pass",
             ("tests/tools/test_photos.py::test_photos_with_another_recipe_makes_again_only_the_files_it_recorded",)),
    Mutation("photos takes a record's file names as they are (../x would be deleted)",
             "accel_train/tools/photos.py", "and OUR_NAME.fullmatch(name) for name", "for name",
             ("tests/tools/test_photos.py::test_a_record_naming_a_file_outside_the_folder_deletes_nothing_and_is_one_line",)),
    Mutation("export stages under the fixed name .OUT.partial, removing whatever was there",
             "accel_train/tools/export.py",
             "        staging = Path(tempfile.mkdtemp(prefix=f\".{folder.name}.export-\", dir=next(\n"
             "            above for above in folder.parents if above.is_dir())))",
             "        staging = folder.with_name(f\".{folder.name}.partial\")\n"
             "        shutil.rmtree(staging, ignore_errors=True)\n        staging.mkdir(parents=True)",
             ("tests/tools/test_export.py::test_an_export_stages_under_a_name_of_its_own_and_leaves_whatever_else_is_beside_its_output",)),
    Mutation("export's output= a link taken as the folder itself (rmdir of a link)",
             "accel_train/tools/export.py",
             "    folder = Path(output).resolve() if Path(output).is_symlink() else Path(output)",
             "    folder = Path(output)",
             ("tests/tools/test_export.py::test_an_export_through_a_link_to_a_folder_goes_into_the_folder_it_names",)),
    Mutation("a file, a link to nothing or a path below a file taken for a place a folder can be",
             "accel_train/storage.py", "    if path.is_symlink() and not path.exists():\n", "    if False:\n",
             ("tests/tools/test_export.py::test_an_export_where_no_folder_can_be_is_one_line_and_touches_nothing",
              "tests/tools/test_photos.py::test_photos_where_no_folder_can_be_is_one_line_and_makes_nothing")),
    # Issue 66, item 8: the rest as promised
    Mutation("a committed checkpoint whose checkpoint.json does not read passed over in silence",
             "accel_train/run/checkpoint.py",
             "                warn(logger, accelerator, f\"checkpoint {shown(folder)} is unusable ({why}); passed "
             "over\")",
             "                pass",
             ("tests/checkpoints/test_a_checkpoint_runs_no_code_and_damage_never_resumes.py::test_a_damaged_checkpoint_json_of_the_newest_checkpoint_is_one_warning_and_the_previous_checkpoint_resumes",)),
    Mutation("a checkpoint.json without a key every reader counts on taken for a checkpoint",
             "accel_train/run/checkpoint_files.py",
             "    wrong = next((key for key, kind in META_KEYS.items() if not isinstance(meta.get(key), kind)), None)",
             "    wrong = None",
             ("tests/checkpoints/test_a_checkpoint_runs_no_code_and_damage_never_resumes.py::test_a_damaged_checkpoint_json_of_the_newest_checkpoint_is_one_warning_and_the_previous_checkpoint_resumes",)),
    Mutation("eval and init_from read a checkpoint's weights that its damaged checkpoint.json cannot vouch for",
             "accel_train/run/weights.py", "    if meta is None:\n        raise UnreadableFileError(",
             "    if meta is None:\n        return\n        raise UnreadableFileError(",
             ("tests/checkpoints/test_a_checkpoint_runs_no_code_and_damage_never_resumes.py::test_eval_and_init_from_of_a_checkpoint_whose_checkpoint_json_is_damaged_refuse_its_weights_in_one_line",)),
    Mutation("~ in path keys left as typed (a folder named ~)",
             "accel_train/config/recipes.py", "    expand_paths(config)\n", "",
             ("tests/config/test_config_and_command_line.py::test_a_tilde_in_every_path_key_is_the_home_folder_the_same_in_a_recipe_and_on_the_command_line",
              "tests/config/test_config_and_command_line.py::test_a_recipe_with_output_dir_under_tilde_trains_there_and_never_makes_a_folder_named_tilde")),
    Mutation("~ in the commands' path arguments left as typed",
             "accel_train/cli.py", "expand_home(value) if name in PATH_ARGUMENTS else value", "value",
             ("tests/config/test_config_and_command_line.py::test_a_recipe_with_output_dir_under_tilde_trains_there_and_never_makes_a_folder_named_tilde",)),
    Mutation("a dataset folder's loading script handed to datasets",
             "accel_train/data/hub.py", "    if script.is_file():\n        raise DataNotFoundError(",
             "    if False:\n        raise DataNotFoundError(",
             ("tests/workloads/test_hub_models_and_datasets.py::test_a_dataset_loading_script_never_runs_and_is_one_line",)),
    Mutation("data.args.trust_remote_code passed on to datasets",
             "accel_train/data/hub.py", '    if "trust_remote_code" in args:', "    if False:",
             ("tests/workloads/test_hub_models_and_datasets.py::test_a_dataset_loading_script_never_runs_and_is_one_line",)),
    Mutation("pickled weights that weights_only refuses left to transformers' traceback",
             "accel_train/workloads/hf_models.py",
             "    except (OSError, ValueError, pickle.UnpicklingError) as err:",
             "    except (OSError, ValueError) as err:",
             ("tests/workloads/test_hub_models_and_datasets.py::test_allowed_pickled_weights_that_weights_only_refuses_are_one_line_naming_the_file_and_nothing_runs",)),
    # Issue 66, item 5: a shard index is checked before use, where it is read (format.py, Shard.check) and where a
    # sample is read (sample_members); the cache builds its paths from checked hashes only.
    Mutation("a shard index used unchecked (a block hash such as ../../victim taken for a file name)",
             "accel_train/data/shards/format.py", "        shard.check()\n        return shard", "        return shard",
             ("tests/data/test_shard_indexes_are_checked_before_use.py::-k "
              "names_a_file_outside_the_cache or an_index_that_cannot_describe_its_tar",)),
    Mutation("the block cache builds a block's path from any hash (its own checks dropped)",
             "accel_train/data/shards/cache.py",
             "        if not is_sha256(sha256):",  # an early return: neither the name rule nor the inside check
             '        return self.folder / "blocks" / sha256[:2] / sha256\n        if not is_sha256(sha256):',
             ("tests/data/test_shard_indexes_are_checked_before_use.py::"
              "test_a_block_hash_that_names_a_file_outside_the_cache_is_one_line_and_no_file_outside_is_read_or_touched",)),
    Mutation("a sample's bytes not held to one key (an offset missing from the index gives the next sample's bytes)",
             "accel_train/data/shards/format.py",
             "    if parts is not None and key is not None and parts[0] != key:",
             "    if False:",
             ("tests/data/test_shard_indexes_are_checked_before_use.py::test_an_offset_removed_or_moved_stops_the_samples_it_touches_in_one_line_and_never_gives_another_samples_bytes[removed]",)),
    Mutation("an .npy member that np.load refuses (an object array) left to raise its traceback",
             "accel_train/data/shards/dataset.py",
             "            return parse(members[extension])\n        except ValueError as err:",
             "            return parse(members[extension])\n        except KeyError as err:",
             ("tests/data/test_shard_indexes_are_checked_before_use.py::test_an_npy_member_holding_an_object_array_is_one_line_naming_the_shard_and_the_sample",)),
    # Issue 66, item 6: data.max_image_pixels, held on every path that decodes image files, from the header.
    Mutation("an image's declared size not held to data.max_image_pixels (a PNG bomb decoded)",
             "accel_train/data/decode.py", "    if max_pixels is not None and width * height > max_pixels:",
             "    if False:",
             ("tests/data/test_images_over_the_pixel_limit_are_refused_before_decoding.py::test_a_png_bomb_in_an_image_folder_stops_training_in_one_line_and_is_never_decoded",
              "tests/data/test_images_over_the_pixel_limit_are_refused_before_decoding.py::test_every_decode_path_reads_an_image_at_the_limit_and_refuses_one_a_pixel_over_naming_it_and_the_key")),
    Mutation("ImageFolder's loader reads the default limit, not data.max_image_pixels",
             "accel_train/data/imagefolder.py", "else read_image, max_pixels=cfg.max_image_pixels)",
             "else read_image, max_pixels=MAX_IMAGE_PIXELS)",
             ("tests/data/test_images_over_the_pixel_limit_are_refused_before_decoding.py::-k "
              "every_decode_path and imagefolder",)),
    Mutation("an hf: dataset's images decoded under the default limit, not data.max_image_pixels",
             "accel_train/data/hub.py", 'decode_image_bytes(data, name, "hf", self.max_pixels)',
             'decode_image_bytes(data, name, "hf")',
             ("tests/data/test_images_over_the_pixel_limit_are_refused_before_decoding.py::"
              "test_every_decode_path_reads_an_image_at_the_limit_and_refuses_one_a_pixel_over_naming_it_and_the_key"
              "[hf:]",)),
    Mutation("the shard writer stores images as given without their size held to the key",
             "accel_train/data/shards/writer.py", '"shard", max_pixels) as opened:', '"shard", None) as opened:',
             ("tests/data/test_images_over_the_pixel_limit_are_refused_before_decoding.py::"
              "test_every_decode_path_reads_an_image_at_the_limit_and_refuses_one_a_pixel_over_naming_it_and_the_key"
              "[the shard writer, images as given]",
              "tests/data/test_images_over_the_pixel_limit_are_refused_before_decoding.py::test_a_png_bomb_stops_bench_input_in_one_line_before_any_way_is_measured")),
    Mutation("shards decode their images under the default limit, not data.max_image_pixels",
             "accel_train/data/shards/dataset.py",
             "image_mode(index),\n                           cfg.max_image_pixels)", "image_mode(index))",
             ("tests/data/test_images_over_the_pixel_limit_are_refused_before_decoding.py::"
              "test_every_decode_path_reads_an_image_at_the_limit_and_refuses_one_a_pixel_over_naming_it_and_the_key"
              "[shards]",)),
    Mutation("predict reads its files under the default limit, not data.max_image_pixels",
             "accel_train/training/prediction.py", '"predict", self.max_pixels))', '"predict"))',
             ("tests/data/test_images_over_the_pixel_limit_are_refused_before_decoding.py::"
              "test_every_decode_path_reads_an_image_at_the_limit_and_refuses_one_a_pixel_over_naming_it_and_the_key"
              "[predict]",)),
    Mutation("PIL's own limit left lifted after a header's read",
             "accel_train/data/decode.py", "        finally:\n            Image.MAX_IMAGE_PIXELS = limit",
             "        finally:\n            pass",
             ("tests/data/test_images_over_the_pixel_limit_are_refused_before_decoding.py::test_the_limit_is_pils_own_by_default_a_key_with_its_meaning_and_pils_setting_stays_as_it_was",)),
    # issue 67: labels by name on every hf: path; grey data for RGB models (data.channels)
    Mutation("an hf: split's labels taken by position (each parquet or arrow file's integers read by the first "
             "file's names)",
             "accel_train/data/hub.py", "    return SplitLabels(mapped, own)", "    return SplitLabels(labels, names)",
             ("tests/workloads/test_hub_models_and_datasets.py::test_an_hf_dataset_finds_its_columns_by_type_and_labels_each_split_by_the_names_it_was_written_with",
              "tests/workloads/test_hub_models_and_datasets.py::test_an_hf_model_on_an_hf_dataset_trains_evaluates_and_predicts_by_its_classes_names")),
    Mutation("an hf: image folder's training classes those of all its splits' folders (a test-only class trained on "
             "in silence)",
             "accel_train/data/hub.py", "    if rows.info.builder_name in FOLDER_BUILDERS:", "    if False:",
             ("tests/workloads/test_hub_models_and_datasets.py::test_an_hf_evaluation_class_the_run_never_trained_on_is_one_line_exit_3_before_anything_trains",)),
    Mutation("images given unconverted to a model that takes other channels (grey into resnet18's RGB stem)",
             "accel_train/data/channels.py", "    if own == channels:\n        return images",
             "    if True:\n        return images",
             ("tests/data/test_image_channels_converted_for_the_model.py::test_resnet18_trains_on_fashion_mnist_as_given_and_eval_and_predict_of_its_run_agree",)),
    Mutation("a torchvision model's channels left to the data's (its RGB stem fed one channel)",
             "accel_train/workloads/models.py", "    return InputDefaults(channels=TORCHVISION_CHANNELS)",
             "    return InputDefaults()",
             ("tests/data/test_image_channels_converted_for_the_model.py::test_resnet18_trains_on_fashion_mnist_as_given_and_eval_and_predict_of_its_run_agree",)),
    Mutation("the channels a model built for the data was given not recorded in config.yaml",
             "accel_train/data/__init__.py", "        cfg.channels = train.image_shape[0]", "        pass",
             ("tests/data/test_image_channels_converted_for_the_model.py::test_a_model_built_for_the_data_records_the_datas_channels_in_config_yaml",)),
    # Issue 66, item 4: one writer per run folder (run/lease.py)
    Mutation("the lease check skipped (a live holder's lease ignored: a second start into its folder trains too)",
             "accel_train/run/lease.py", "            raise RunFolderHeld(held_line(self.shown, found))",
             "            return",
             ("tests/run_folder/test_one_writer_per_run_folder.py::test_of_two_starts_racing_for_a_run_folder_ten_times_exactly_one_holds_it_and_the_other_is_refused_naming_it[local]",
              "tests/run_folder/test_one_writer_per_run_folder.py::test_two_starts_into_one_folder_one_trains_and_the_other_exits_2_naming_it_and_metrics_stay_whole[local]")),
    Mutation("a holder whose process has ended kept until its lease expires (kill -9, then resume=auto refused)",
             "accel_train/run/lease.py", "    if holder.is_gone():\n        return GONE",
             "    if False:\n        return GONE",
             ("tests/run_folder/test_one_writer_per_run_folder.py::test_a_lease_whose_process_has_ended_on_this_machine_is_taken_over_at_once_saying_whose_it_was[local]",)),
    Mutation("a lease of this job not waited for (an elastic restart whose main process moved is refused)",
             "accel_train/run/lease.py", "    if (me.job is not None and holder.job == me.job) or me.restart > 0:",
             "    if False:",
             ("tests/run_folder/test_one_writer_per_run_folder.py::test_a_restart_by_the_launcher_is_the_same_writer_and_an_independent_start_on_the_same_port_is_another",
              "tests/run_folder/test_one_writer_per_run_folder.py::test_a_live_holder_on_another_machine_is_refused_at_once_and_one_of_this_job_is_waited_for_until_it_expires")),
    Mutation("a start whose lease was taken over writes on",
             "accel_train/run/lease.py", "        self.on_lost(code)", "        pass",
             ("tests/run_folder/test_one_writer_per_run_folder.py::test_a_start_whose_lease_was_taken_over_stops_at_its_next_renewal[local]",)),
    Mutation("a local lease replaced without comparing it to the version read (two takers of an expired lease both "
             "win)",
             "accel_train/storage.py",
             "                if current is None or _digest(current) != version:\n                    return None\n"
             "                partial",
             "                if current is None:\n                    return None\n                partial",
             ("tests/run_folder/test_one_writer_per_run_folder.py::test_a_lease_is_written_only_where_it_is_absent_or_still_the_version_read[local]",
              "tests/run_folder/test_one_writer_per_run_folder.py::test_of_two_starts_taking_over_an_expired_lease_ten_times_exactly_one_wins[local]")),
    Mutation("an S3 lease replaced without If-Match (two takers of an expired lease both win)",
             "accel_train/storage.py", "lambda: self._put_if(name, data, IfMatch=version)",
             "lambda: self._put_if(name, data)",
             ("tests/run_folder/test_one_writer_per_run_folder.py::test_a_lease_is_written_only_where_it_is_absent_or_still_the_version_read[s3]",
              "tests/run_folder/test_one_writer_per_run_folder.py::test_of_two_starts_taking_over_an_expired_lease_ten_times_exactly_one_wins[s3]")),
    Mutation("a run folder in a store staged without a claim (a second start on the machine empties the holder's "
             "staging)",
             "accel_train/run/place.py", "        mirror.claim()  # before the pull empties it",
             "        pass  # before the pull empties it",
             ("tests/run_folder/test_one_writer_per_run_folder.py::test_two_starts_into_one_folder_one_trains_and_the_other_exits_2_naming_it_and_metrics_stay_whole[s3]",)),
]


HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Interrupted(BaseException):
    """A signal asked the run to end: the tests under way are ended and the mutated file restored first."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_interrupted(signum, frame) -> None:
    for handled in HANDLED_SIGNALS:  # a second Ctrl-C must not cut the restore short
        signal.signal(handled, signal.SIG_IGN)
    raise Interrupted(signum)


def pytest_args(tests: tuple[str, ...]) -> list[str]:
    args = []
    for test in tests:
        path, _, expression = test.partition("::-k ")
        args += [path, "-k", expression] if expression else [test]
    return args


def baseline_batches(tests: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The pytest runs that check every selection: pytest takes one -k, so each "::-k" selection runs on its own
    (joined, the last -k would replace the others) and the node ids and files all together."""
    plain = tuple(test for test in tests if "::-k " not in test)
    return ([plain] if plain else []) + [(test,) for test in tests if "::-k " in test]


def run_tests(tests: tuple[str, ...], repo: Path = REPO) -> tuple[int, list[str], float]:
    started = time.monotonic()
    # Its own process group, so that an interrupted run ends pytest and whatever it started, and not more.
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rfE", *pytest_args(tests)]
    with subprocess.Popen(command, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as tests_run:
        try:
            stdout, _ = tests_run.communicate()
        except BaseException:
            end_process_group(tests_run)
            raise
    # A fixture that trains fails as an ERROR of the tests using it
    failed = [f"{word.lower()} {line[len(word) + 1:].split(' - ')[0]}" for line in stdout.splitlines()
              for word in ("FAILED", "ERROR") if line.startswith(f"{word} ")]  # node ids may hold spaces
    return tests_run.returncode, failed, time.monotonic() - started


def end_process_group(process: subprocess.Popen) -> None:
    for sent, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sent)
        except ProcessLookupError:
            return
        try:
            process.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def restore_command(file: str) -> str:
    return f"git checkout -- {file}"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout


def refusal(mutations: list[Mutation], repo: Path = REPO) -> str | None:
    """One line saying why the run must not start: tracked files with uncommitted changes, naming the command
    that restores any a killed run left mutated. None when the tracked files are those of HEAD."""
    try:
        changed = git(repo, "diff", "--name-only", "-z", "HEAD").split("\0")  # staged or not
    except (OSError, subprocess.CalledProcessError) as err:
        detail = (getattr(err, "stderr", "") or str(err)).strip().splitlines()
        return (f"cannot list the changes of {repo} with git ({detail[0] if detail else err}): the run needs a "
                "git checkout, to restore each file it breaks")
    changed = [file for file in changed if file]
    if not changed:
        return None
    left = {}
    for mutation in mutations:
        path = repo / mutation.file
        if mutation.file in changed and mutation.file not in left and path.is_file():
            committed = git(repo, "show", f"HEAD:{mutation.file}")
            if path.read_text() == committed.replace(mutation.original, mutation.broken):
                left[mutation.file] = mutation
    reasons = [f"{file} still holds the mutation \"{mutation.name}\" of a run that was killed; restore it with "
               f"`{restore_command(file)}`" for file, mutation in left.items()]
    others = [file for file in changed if file not in left]
    if others:
        reasons.append(f"uncommitted changes to {', '.join(others)}: commit or stash them (each mutation breaks a "
                       "committed file, and a killed run is undone with git checkout)")
    return "refusing to start: " + "; ".join(reasons)


@contextmanager
def mutated(mutation: Mutation, repo: Path = REPO):
    """Apply `mutation` for the duration of a with block; the file is restored byte for byte afterwards, also
    when a signal ends the run (SIGKILL aside: the caller names the restoring command before it mutates)."""
    path = repo / mutation.file
    source = path.read_text()
    if source.count(mutation.original) != 1:
        raise SystemExit(f"{mutation.name}: the text to break is no longer found once in {mutation.file}; "
                         "update tests/mutations/run.py")
    try:
        path.write_text(source.replace(mutation.original, mutation.broken))
        _forget_bytecode(path)
        yield
    finally:
        path.write_text(source)
        _forget_bytecode(path)


def _forget_bytecode(path: Path) -> None:
    """Removes the file's compiled copies (Python's, and pytest's with rewritten asserts): one compiled in the same
    second from a file of the same size is taken as current, and would run the other version of the file."""
    for compiled in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        compiled.unlink(missing_ok=True)


def main(argv: list[str], mutations: list[Mutation] = MUTATIONS, repo: Path = REPO) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="words of the mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="name the mutations and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip running the selected tests unbroken first")
    args = parser.parse_args(argv)
    chosen = [m for m in mutations if not args.names or any(word in m.name for word in args.names)]
    if not chosen:
        print(f"no mutation's name contains {' or '.join(map(repr, args.names))}; choose words from:", file=sys.stderr)
    if args.list or not chosen:
        print("\n".join(m.name for m in mutations))
        return 0 if args.list else 2
    if why := refusal(mutations, repo):
        print(f"mutations: {why}", file=sys.stderr)
        return 2
    for handled in HANDLED_SIGNALS:
        signal.signal(handled, raise_interrupted)
    try:
        return run_mutations(chosen, args.no_baseline, repo)
    except Interrupted as stop:
        print(f"\nmutations: stopped by {stop}; the tests under way were ended and the source is restored",
              file=sys.stderr)
        return 128 + stop.signum


def run_mutations(chosen: list[Mutation], no_baseline: bool, repo: Path) -> int:
    if not no_baseline:
        code, failed, seconds = 0, [], 0.0
        for tests in baseline_batches(tuple(dict.fromkeys(test for m in chosen for test in m.tests))):
            batch_code, batch_failed, batch_seconds = run_tests(tests, repo)
            code, failed, seconds = code or batch_code, failed + batch_failed, seconds + batch_seconds
        print(f"baseline: {'pass' if code == 0 else f'FAILED {failed or code}'} ({seconds:.0f} s)", flush=True)
        if code != 0:
            return 1
    missed = 0
    for number, mutation in enumerate(chosen, 1):
        # Printed before the file changes: what restores it if this run is killed with SIGKILL.
        print(f"{number:2d}. {mutation.name} [{mutation.file}; if killed: {restore_command(mutation.file)}]: ",
              end="", flush=True)
        with mutated(mutation, repo):
            code, failed, seconds = run_tests(mutation.tests, repo)
        caught = code == 1 and failed
        missed += not caught
        verdict = f"caught by {', '.join(failed)}" if caught else f"NOT CAUGHT (pytest exit {code})"
        print(f"{verdict} ({seconds:.0f} s)", flush=True)
    print(f"{len(chosen) - missed} of {len(chosen)} mutations caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
