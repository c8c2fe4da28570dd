"""Contracts of train.compile and train.channels_last: they change speed, never what a model computes or exports; and
of train.deterministic and train.tf32, which trade speed for the same numbers on every GPU run."""

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from accel_train.workloads.models import BatchNormCNN, compile_model, tune_for_device


@pytest.mark.processes  # torch.compile's inductor runs the C++ compiler: not for the fast tier
def test_a_compiled_channels_last_model_computes_the_same_and_exports_the_same_weights_under_the_same_names(tmp_path):
    torch.manual_seed(0)
    plain = BatchNormCNN(10, (1, 28, 28))
    tuned = BatchNormCNN(10, (1, 28, 28))
    tuned.load_state_dict(plain.state_dict())
    accelerator = Accelerator(cpu=True)
    tuned = accelerator.prepare(compile_model(tune_for_device(tuned, channels_last=True), compile=True))
    assert tuned.features[0].weight.is_contiguous(memory_format=torch.channels_last)
    plain.eval(), tuned.eval()  # dropout off: the same function on both sides
    images = torch.randn(4, 1, 28, 28)
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        assert torch.allclose(tuned(images), plain(images), atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, "the forward pass was not compiled"
    accelerator.save_model(tuned, tmp_path)
    exported = load_file(str(tmp_path / "model.safetensors"))
    assert exported.keys() == plain.state_dict().keys()
    assert all(torch.equal(exported[name], value) for name, value in plain.state_dict().items())


@pytest.fixture
def numerics():
    """torch's own defaults again after the test: the switches are process-wide."""
    yield
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, False
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("settings, deterministic, tf32", [
    ([], False, True),  # fast: cuDNN picks its fastest algorithms, fp32 products on TF32 tensor cores
    (["train.deterministic=true"], True, False),
    (["train.tf32=false"], False, False),
    (["train.deterministic=true", "train.tf32=false"], True, False),
])
def test_deterministic_and_tf32_set_how_the_gpu_computes_before_the_model_runs(numerics, settings, deterministic,
                                                                                 tf32, tmp_path):
    from support.commands import train_in_process

    train_in_process("mnist_cnn", "data.synthetic=true", "data.train_subset=12", "data.eval_subset=12",
                     "train.batch_size=12", "train.max_steps=1", "train.plot=false", f"output_dir={tmp_path}",
                     *settings)
    assert torch.backends.cudnn.benchmark is not deterministic and torch.backends.cudnn.deterministic is deterministic
    assert torch.are_deterministic_algorithms_enabled() is deterministic
    assert torch.backends.cuda.matmul.allow_tf32 is tf32 and torch.backends.cudnn.allow_tf32 is tf32
