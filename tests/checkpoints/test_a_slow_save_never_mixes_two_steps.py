"""Contracts of the background save when its writer is slow (a stuck disk or store): a checkpoint holds its own step's
state though its write outlasts checkpoint.upload_wait_s and training saves again meanwhile, and host memory holds
at most two copies of the state. In this process, on a small model: the writer is held by a job queued before it."""

import threading

import pytest
import torch
from safetensors.torch import load_file

from accel_train.config import load_config
from accel_train.run.checkpoint import Checkpoints, list_checkpoints
from accel_train.state import Progress


@pytest.fixture
def saves(tmp_path):
    """(checkpoints, model, a function that sets every weight to a number) of a run saving into tmp_path."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    config = load_config("mnist_cnn", [f"output_dir={tmp_path}", "checkpoint.upload_wait_s=0.2",
                                        "checkpoint.keep_last=9"])

    def weights_become(value: float) -> None:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.fill_(value)

    with Checkpoints(config, accelerator) as checkpoints:
        yield checkpoints, weights_become
        assert checkpoints.worker.idle_within(60)  # every write done before the end's shorter wait


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_snapshot_of_cuda_tensors_is_copied_into_pinned_host_memory_and_read_after_its_copies_end():
    from accelerate import Accelerator

    from accel_train.run.snapshot import Snapshots

    accelerator = Accelerator()
    model = accelerator.prepare(torch.nn.Linear(1024, 1024))
    snapshot = Snapshots().take(accelerator)
    weights = snapshot.files["model.safetensors"][0]
    assert all(tensor.is_pinned() for tensor in weights.values())
    snapshot.copied.synchronize()  # what the writer does before it reads them
    assert all(torch.equal(weights[name], tensor.cpu()) for name, tensor in model.state_dict().items())
