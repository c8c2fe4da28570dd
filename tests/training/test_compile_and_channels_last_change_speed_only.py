"""Contract of train.compile and train.channels_last: they change speed, never what a model computes or exports."""

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from accel_train.workloads.models import BatchNormCNN, tune_for_device


@pytest.mark.processes  # torch.compile's inductor runs the C++ compiler: not for the fast tier
def test_a_compiled_channels_last_model_computes_the_same_and_exports_the_same_weights_under_the_same_names(tmp_path):
    torch.manual_seed(0)
    plain = BatchNormCNN(10, (1, 28, 28))
    tuned = BatchNormCNN(10, (1, 28, 28))
    tuned.load_state_dict(plain.state_dict())
    accelerator = Accelerator(cpu=True)
    tuned = accelerator.prepare(tune_for_device(tuned, accelerator.device, channels_last=True, compile=True))
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
