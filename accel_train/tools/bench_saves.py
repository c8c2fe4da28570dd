"""`accel-train bench --saves [--saves-into URL]`: how long a checkpoint holds training, saved in the background as a
run saves it, against the synchronous save a hand-written loop does (accelerator.save_state, each file flushed to
disk, then uploaded when the run folder is in a store).

The model is the recipe's (default: ResNet-50 on CIFAR-10's shape, about 100 MB of weights), with its optimizer's state
after one step on random inputs: what a checkpoint holds. The synchronous save is measured `repeats` times into fresh
folders; the background save as one run saves, `repeats` + 1 times (the first allocates the host buffers the others
reuse: reported apart). The medians are printed, one line each, and returned.
"""

from __future__ import annotations

import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from accel_train.config import load_config
from accel_train.run.place import RunPlace, run_folder_patience
from accel_train.storage import Store

logger = logging.getLogger(__name__)


def run_saves_bench(recipe: str, overrides: list[str], url: str | None, repeats: int = 3) -> dict:
    from accel_train.distributed.accelerator import make_accelerator
    from accel_train.run.checkpoint import Checkpoints
    from accel_train.run.checkpoint_files import fsync
    from accel_train.run.snapshot import Prepared
    from accel_train.state import Progress
    from accel_train.training.optim import build_optimizer
    from accel_train.workloads.models import build_model

    config = load_config(recipe, ["train.progress_bar=false", *overrides])
    accelerator = make_accelerator(config.seed, config.train.collective_timeout_s, [], None)
    side = config.data.image_size or 32
    model = build_model(config.model, config.data.num_classes or 10, (3, side, side))
    optimizer = build_optimizer(config.train, model)
    model, optimizer = accelerator.prepare(model, optimizer)
    first_step(model, optimizer, side)
    size_mb = sum(tensor.numel() * tensor.element_size() for tensor in model.parameters()) / 2**20
    scratch = Path(tempfile.mkdtemp(prefix="accel-train-bench-saves-"))
    where = url or str(scratch)
    logger.info(f"bench --saves: {config.model.name}, {size_mb:.0f} MiB of weights plus {config.train.optimizer}'s "
                f"state, into {where}")
    synchronous, blocked, total = [], [], []
    try:
        for repeat in range(repeats):
            folder = scratch / f"sync-{repeat}"
            began = time.perf_counter()
            accelerator.save_state(str(folder))
            for path in folder.iterdir():
                fsync(path)
            if url:
                store = Store(f"{url.rstrip('/')}/sync-{repeat}", "output_dir", run_folder_patience(config))
                for path in sorted(folder.iterdir()):
                    store.put(path, path.name)
            synchronous.append(time.perf_counter() - began)

        # One run's saves, as training makes them: the first allocates the host buffers, the others reuse them.
        run_url = f"{url.rstrip('/')}/background" if url else str(scratch / "background")
        place = RunPlace.open(run_url, run_folder_patience(config))
        checkpoints = Checkpoints(load_config(recipe, [*overrides, f"output_dir={run_url}"]), accelerator, place,
                                  prepared=Prepared(models=[model], optimizers=[optimizer]))
        with checkpoints:
            for step in range(1, repeats + 2):
                before, began = checkpoints.blocked_s, time.perf_counter()
                checkpoints.save(Progress(steps_per_epoch=repeats + 1, total_steps=repeats + 1, step=step),
                                 evaluated=False)
                blocked.append(checkpoints.blocked_s - before)
                checkpoints.settle()
                total.append(time.perf_counter() - began)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    first_blocked = blocked.pop(0)
    total.pop(0)
    result = {"synchronous_s": statistics.median(synchronous), "blocked_s": statistics.median(blocked),
              "first_blocked_s": first_blocked, "background_total_s": statistics.median(total)}
    result["blocked_share"] = result["blocked_s"] / result["synchronous_s"]
    logger.info(f"synchronous save (save_state, flushed{', uploaded' if url else ''}): {result['synchronous_s']:.2f} s")
    logger.info(f"background save: training blocked {result['blocked_s']:.3f} s ({result['blocked_share']:.1%} of the "
                f"synchronous save; the run's first save {first_blocked:.3f} s, making its host buffers), written"
                f"{' and uploaded' if url else ''} in {result['background_total_s']:.2f} s in all "
                f"(medians of {repeats})")
    return result


def first_step(model, optimizer, side: int) -> None:
    """One optimizer step on random inputs, so that the optimizer's state (AdamW's moments) is in the checkpoint; the
    inputs are made where the model is (on a GPU once prepared)."""
    import torch

    device = next(model.parameters()).device
    inputs = torch.randn(2, 3, side, side, device=device)
    torch.nn.functional.cross_entropy(model(inputs), torch.tensor([0, 1], device=device)).backward()
    optimizer.step()
