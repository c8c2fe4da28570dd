"""Contracts of the background save when its writer is slow (a stuck disk or store): a checkpoint holds its own step's
state though its write outlasts checkpoint.upload_wait_s and training saves again meanwhile, and host memory holds
at most two copies of the state; a save that training went on without is committed when it ends, its files never
deleted by the saves after it, or its failure is said. In this process, on a small model: the writer is held by a
job queued before it, or an upload by the fault proxy in front of an S3 store (moto, in a thread of this process).
And what the background save writes: the files accelerator.save_state writes, with the same contents."""

import threading
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import load, load_file

from accel_train import hooks
from accel_train.config import load_config
from accel_train.run.checkpoint import Checkpoints
from accel_train.run.checkpoint_files import list_checkpoints
from accel_train.run.place import RunPlace
from accel_train.run.snapshot import Prepared
from accel_train.state import Progress


@contextmanager
def checkpoints_of_a_run(output_dir: str):
    """(checkpoints, a function that sets every weight to a number) of a run saving into `output_dir` (a URL's place
    opened with a patience of 1 s), waiting 0.2 s for a save (checkpoint.upload_wait_s)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    config = load_config("mnist_cnn", [f"output_dir={output_dir}", "checkpoint.upload_wait_s=0.2",
                                        "checkpoint.keep_last=9", "data.store_patience_s=1"])

    def weights_become(value: float) -> None:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.fill_(value)

    place, prepared = RunPlace.open(output_dir, patience_s=1), Prepared(models=[model], optimizers=[optimizer])
    with Checkpoints(config, accelerator, place, prepared=prepared) as checkpoints:
        yield checkpoints, weights_become
        assert checkpoints.worker.idle_within(60)  # every write done before the end's shorter wait


@pytest.fixture
def saves(tmp_path):
    """A run saving into tmp_path (checkpoints_of_a_run)."""
    with checkpoints_of_a_run(str(tmp_path)) as run:
        yield run


@pytest.fixture
def saves_into_a_store(object_store, tmp_path, monkeypatch):
    """A run saving into the store (checkpoints_of_a_run), staged in tmp_path; and the store."""
    monkeypatch.setenv("ACCEL_TRAIN_STAGING", str(tmp_path / "staging"))
    url = object_store.url("runs/slow")
    with checkpoints_of_a_run(url) as (checkpoints, weights_become):
        yield checkpoints, weights_become, object_store
        object_store.proxy.release()  # an upload a failed test left held goes on: the run ends before the next test


def save(checkpoints: Checkpoints, step: int) -> None:
    checkpoints.save(Progress(steps_per_epoch=10, total_steps=10, step=step), evaluated=False)


def hold_the_writer(checkpoints: Checkpoints) -> threading.Event:
    """The writer busy until the returned event is set, as with a slow disk or store."""
    release = threading.Event()
    checkpoints.worker.submit(release.wait)
    return release


def saved_weights(checkpoints: Checkpoints) -> dict[int, float]:
    """{step: the one value of its model.safetensors} of every committed checkpoint (nan if its values differ)."""
    found = {}
    for folder, meta in list_checkpoints(checkpoints.directory):
        values = torch.cat([tensor.flatten() for tensor in load_file(folder / "model.safetensors").values()]).unique()
        found[meta["step"]] = values.item() if len(values) == 1 else float("nan")
    return found


def test_a_checkpoint_whose_write_outlasts_upload_wait_s_holds_its_own_step_though_the_next_save_came_meanwhile(
        saves):
    checkpoints, weights_become = saves
    release = hold_the_writer(checkpoints)
    weights_become(1.0)
    save(checkpoints, 1)
    weights_become(2.0)
    save(checkpoints, 2)  # waits 0.2 s for step 1's write (checkpoint.upload_wait_s), then goes on without it
    release.set()
    assert checkpoints.worker.idle_within(60)
    assert saved_weights(checkpoints) == {1: 1.0, 2: 2.0}


def test_a_save_while_two_are_still_being_written_is_skipped_with_a_warning_and_the_next_one_is_taken(saves, capsys):
    checkpoints, weights_become = saves
    release = hold_the_writer(checkpoints)
    for step in (1, 2, 3):  # a third copy of the state would only queue behind the two the writer holds
        weights_become(float(step))
        save(checkpoints, step)
    assert "the checkpoint of step 3 is skipped" in capsys.readouterr().err
    release.set()
    assert checkpoints.worker.idle_within(60)
    weights_become(4.0)
    save(checkpoints, 4)
    assert checkpoints.worker.idle_within(60)
    assert saved_weights(checkpoints) == {1: 1.0, 2: 2.0, 4: 4.0}


def hold_the_upload_of_step_1(store) -> None:
    """The upload of step 1's weights is held at the proxy until release(), its staged files written meanwhile."""
    store.proxy.inject("hold", match=lambda method, path: method == "PUT" and
                       path.endswith("/checkpoints/step-00000001/model.safetensors"))


def weights_in_the_store(store) -> dict[int, float]:
    """{step: the one value of its model.safetensors} of every checkpoint committed in the store (by its manifest)."""
    fs, found = store.fs(), {}
    for manifest in sorted(fs.glob(f"{store.bucket}/runs/slow/checkpoints/*/checkpoint.json")):
        folder = manifest.rsplit("/", 1)[0]
        values = torch.cat([tensor.flatten() for tensor in load(fs.cat(f"{folder}/model.safetensors")).values()])
        step = int(folder.rsplit("-", 1)[-1])
        found[step] = values.unique().item() if len(values.unique()) == 1 else float("nan")
    return found


class SavedSteps(hooks.Hooks):
    def __init__(self) -> None:
        self.steps = []

    def checkpoint_saved(self, progress, folder):
        self.steps.append(progress.step)


def test_a_checkpoint_whose_upload_outlasts_upload_wait_s_is_committed_though_training_saved_again_meanwhile(
        saves_into_a_store, capsys):
    checkpoints, weights_become, store = saves_into_a_store
    hold_the_upload_of_step_1(store)
    weights_become(1.0)
    save(checkpoints, 1)
    assert store.proxy.holding.wait(30)  # step 1's files are staged and being uploaded
    weights_become(2.0)
    with hooks.added(saved := SavedSteps()):
        save(checkpoints, 2)  # waits 0.2 s for step 1's upload, then goes on without it; deletes none of its files
        assert "the checkpoint of step 1 is still being uploaded after 0.2 s" in capsys.readouterr().err
        store.proxy.release()
        assert checkpoints.worker.idle_within(60)
        checkpoints.settle()
    assert weights_in_the_store(store) == {1: 1.0, 2: 2.0}
    assert saved.steps == [1, 2], "the hook runs for a checkpoint committed after training went on without it"
    assert "warning" not in capsys.readouterr().err


def test_a_checkpoint_that_training_went_on_without_and_that_then_fails_is_said_in_one_warning_naming_its_step(
        saves_into_a_store, capsys):
    checkpoints, weights_become, store = saves_into_a_store
    hold_the_upload_of_step_1(store)
    store.proxy.inject("503", times=10**6, match=lambda method, path: method == "PUT" and
                       path.endswith("/checkpoints/step-00000001/optimizer.bin"))
    weights_become(1.0)
    save(checkpoints, 1)
    assert store.proxy.holding.wait(30)
    weights_become(2.0)
    save(checkpoints, 2)  # goes on without step 1 after 0.2 s
    store.proxy.release()  # step 1's weights reach the store; its optimizer never does (store_patience_s=1)
    assert checkpoints.worker.idle_within(60)
    store.proxy.clear_faults()
    weights_become(3.0)
    save(checkpoints, 3)  # the first point where the training thread learns how step 1's save ended
    warned = [line for line in capsys.readouterr().err.splitlines() if "the checkpoint of step 1 failed" in line]
    assert len(warned) == 1 and "step-00000001/optimizer.bin" in warned[0], warned
    assert checkpoints.worker.idle_within(60)
    assert weights_in_the_store(store) == {2: 2.0, 3: 3.0}
    assert [meta["step"] for _, meta in list_checkpoints(checkpoints.directory)] == [2, 3], \
        "nothing of step 1 is taken for a checkpoint: resume=auto takes the newest committed one"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_snapshot_of_cuda_tensors_is_copied_into_pinned_host_memory_and_read_after_its_copies_end():
    from accelerate import Accelerator

    from accel_train.run.snapshot import Snapshots

    accelerator = Accelerator()
    model = accelerator.prepare(torch.nn.Linear(1024, 1024))
    snapshot = Snapshots().take(accelerator, Prepared(models=[model]))
    weights = snapshot.files["model.safetensors"][0]
    assert all(tensor.is_pinned() for tensor in weights.values())
    snapshot.copied.synchronize()  # what the writer does before it reads them
    assert all(torch.equal(weights[name], tensor.cpu()) for name, tensor in model.state_dict().items())


def same(saved, synchronous) -> bool:
    """Equal, tensor for tensor and value for value, through any nesting."""
    import numpy as np

    if isinstance(saved, torch.Tensor):
        return isinstance(synchronous, torch.Tensor) and torch.equal(saved, synchronous)
    if isinstance(saved, np.ndarray):
        return np.array_equal(saved, synchronous)
    if isinstance(saved, dict):
        return saved.keys() == synchronous.keys() and all(same(saved[key], synchronous[key]) for key in saved)
    if isinstance(saved, (list, tuple)):
        return len(saved) == len(synchronous) and all(map(same, saved, synchronous))
    return saved == synchronous


def test_a_background_save_writes_the_files_save_state_writes_with_the_same_contents(tmp_path):
    # A run's parts as setup prepares them (a model with buffers, AdamW, a schedule, a loader) and one of accel-train's
    # own with tensors (an EMA module, through Checkpoints' states), one step in: saved in the background, and saved by
    # save_state (Checkpoints without `prepared`), at the same moment.
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    inputs, labels = next(iter(loader))
    accelerator.backward(torch.nn.functional.cross_entropy(model(inputs), labels))
    optimizer.step()
    scheduler.step()
    ema = torch.nn.Linear(8, 2)
    folders = {}
    for way, prepared in (("background", Prepared(models=[model], optimizers=[optimizer], schedulers=[scheduler],
                                                  loaders=[loader])), ("save_state", None)):
        config = load_config("mnist_cnn", [f"output_dir={tmp_path / way}"])
        with Checkpoints(config, accelerator, RunPlace.open(config.output_dir, patience_s=1), states={"ema": ema},
                         prepared=prepared) as checkpoints:
            save(checkpoints, 1)
        ((folder, meta),) = list_checkpoints(checkpoints.directory)
        folders[way] = {path.name: path for path in folder.iterdir() if path.name in meta["files"]}
    written, expected = folders["background"], folders["save_state"]
    assert sorted(written) == sorted(expected) and "ema.safetensors" in written, (sorted(written), sorted(expected))
    assert same(load_file(written["ema.safetensors"]), ema.state_dict())
    for name, path in expected.items():
        if name.endswith(".safetensors"):
            assert same(load_file(written[name]), load_file(path)), name
        elif name.endswith(".json"):
            assert written[name].read_text() == path.read_text(), name
        else:
            assert same(torch.load(written[name], weights_only=False), torch.load(path, weights_only=False)), name
