"""Named points inside a run where code outside the package (a test, a tool) watches it or changes one part of it,
without reassigning anything of the package.

    class Saves(accel_train.hooks.Hooks):
        def checkpoint_saved(self, progress, folder):
            print("saved", progress.step, folder)

    with accel_train.hooks.added(Saves()):
        accel_train.train("fashion_mnist_cnn", ["train.epochs=1"])   # or cli.main([...]) in a wrapper script

Every point is reached on every process, in the order the run reaches it; the defaults change nothing. Hooks added
together are called in the order given, each one's returned value handed to the next. The observers (console, run
folder, trackers) are the product's own watchers and get a read-only State; these points are lower level (the
accelerator, the data, a forward pass) and exist so that what a test records or injects is named here, and a renamed
function inside the package fails loudly instead of silently leaving a recorder unused.
"""

from __future__ import annotations

from contextlib import contextmanager


class Hooks:
    """Override the points you need."""

    def accelerator_options(self, options: dict) -> dict:
        """The keyword arguments `Accelerator(...)` is about to be called with (cpu, mixed_precision, ...)."""
        return options

    def accelerator_made(self, accelerator) -> None:
        """Every Accelerator the package makes (training, eval, predict), once the world-size check has passed."""

    def data_built(self, data, split: str):
        """The data of a split ("train", "val" or "test") before its loader is made; returns the Data to use."""
        return data

    def model_prepared(self, model) -> None:
        """The model as `accelerator.prepare` returned it for training (DDP's wrapper, FSDP's, or the model)."""

    def micro_batch_loaded(self, progress, batch) -> None:
        """A training micro-batch as this process loaded it (its share of the global batch), before the task mixes
        it (MixUp / CutMix); `progress.epoch` is its epoch."""

    def after_forward(self, phase: str, step: int | None, model, batch, outputs: dict) -> dict:
        """A task's forward pass is done: phase "train" (training_step's terms, for optimizer step `step`), "search"
        (micro_batch_size=auto trying a size before training; `step` None) or "eval" (eval_step's outputs; `step`
        None). Returns the outputs to use; raising here is raising from the forward pass."""
        return outputs

    def optimizer_stepped(self, progress, terms: dict, skipped, lr: float) -> None:
        """Optimizer step `progress.step` is done: its terms, whether the non-finite guard skipped it (a device
        tensor), and the LR it applied."""

    def checkpoint_saving(self, progress) -> None:
        """A checkpoint of `progress.step` is about to be saved (every process is here)."""

    def checkpoint_saved(self, progress, folder) -> None:
        """The checkpoint of `progress.step` is committed at `folder` (a path, or a URL for a run folder in a store).
        Saves are written in the background: this runs on the training thread at the first point that waits for the
        commit (the next save, or the end of the run), on every process (where this process's part is done)."""

    def process_ends(self, code: int) -> bool:
        """A process is about to end itself (os._exit) with `code`: a stuck one (6), or one whose run folder's lease
        another start took over or that could not renew it (2; 3 or 74); False keeps it running (a test that trains
        in its own process)."""
        return True


_added: list[Hooks] = []


@contextmanager
def added(*hooks: Hooks):
    """The hooks are called while inside, after any added before."""
    _added.extend(hooks)
    try:
        yield
    finally:
        for hook in hooks:
            _added.remove(hook)


class _Every(Hooks):
    """Calls each added hook in turn."""

    def accelerator_options(self, options):
        for hook in _added:
            options = hook.accelerator_options(options)
        return options

    def accelerator_made(self, accelerator):
        for hook in _added:
            hook.accelerator_made(accelerator)

    def data_built(self, data, split):
        for hook in _added:
            data = hook.data_built(data, split)
        return data

    def model_prepared(self, model):
        for hook in _added:
            hook.model_prepared(model)

    def micro_batch_loaded(self, progress, batch):
        for hook in _added:
            hook.micro_batch_loaded(progress, batch)

    def after_forward(self, phase, step, model, batch, outputs):
        for hook in _added:
            outputs = hook.after_forward(phase, step, model, batch, outputs)
        return outputs

    def optimizer_stepped(self, progress, terms, skipped, lr):
        for hook in _added:
            hook.optimizer_stepped(progress, terms, skipped, lr)

    def checkpoint_saving(self, progress):
        for hook in _added:
            hook.checkpoint_saving(progress)

    def checkpoint_saved(self, progress, folder):
        for hook in _added:
            hook.checkpoint_saved(progress, folder)

    def process_ends(self, code):
        return all([hook.process_ends(code) for hook in _added])


_EVERY = _Every()


def every() -> Hooks:
    """The hooks added now, as one."""
    return _EVERY
