"""`accel-train bench --dropout`: what dropout keyed by sample (training/dropout.py) costs against torch's own, in
training samples per second (forward, backward, an SGD step), on the demo CNN (mnist_cnn, 28 px, batch 64) and on a
ViT-B-sized stack of transformer blocks (nn.TransformerEncoderLayer: width 768, 12 heads, 197 tokens, dropout 0.1),
eager and compiled (torch.compile: the keys are device tensors updated in place, so the graph is traced once).
Each row is the best of 3 timed windows after a warm-up one (compilation falls in the warm-up)."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

WINDOWS = 3


class _Accelerator:  # what DropoutKeys asks of one: where warnings go
    is_main_process = True

    def __init__(self, device: torch.device) -> None:
        self.device = device


def vit_b_stack(blocks: int = 4) -> nn.Module:
    layer = nn.TransformerEncoderLayer(768, 12, 3072, dropout=0.1, batch_first=True, norm_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, blocks, enable_nested_tensor=False), nn.Flatten(),
                         nn.LazyLinear(10))


def workloads(quick: bool) -> list[tuple[str, callable, int, tuple[int, ...]]]:
    from accel_train.workloads.models import MnistCNN

    tokens, blocks = (16, 1) if quick else (197, 4)
    return [("demo CNN (mnist_cnn, 28 px, batch 64)", lambda: MnistCNN(10, (1, 28, 28)), 64, (1, 28, 28)),
            (f"ViT-B-sized blocks ({blocks} x width 768, {tokens} tokens, batch 8)", lambda: vit_b_stack(blocks), 8,
             (tokens, 768))]


def steps_per_s(make, batch: int, shape: tuple[int, ...], keyed: bool, compiled: bool, steps: int,
                device: torch.device) -> float:
    from accel_train.training.dropout import key_dropout

    torch.manual_seed(0)
    model = make().to(device)
    model(torch.zeros(2, *shape, device=device))  # lazy layers made
    keys = key_dropout(model, 0, _Accelerator(device)) if keyed else None
    if compiled:
        model.compile()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    inputs, labels = torch.randn(batch, *shape, device=device), torch.randint(0, 10, (batch,), device=device)
    model.train()
    seconds, step = [], 0
    for _ in range(1 + WINDOWS):
        started = time.perf_counter()
        for _ in range(steps):
            step += 1
            with keys.keyed(torch.arange(batch, device=device) + step * batch, step, model) if keyed \
                    else contextlib.nullcontext():
                loss = nn.functional.cross_entropy(model(inputs), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loss.item()
        seconds.append(time.perf_counter() - started)
    return steps / min(seconds[1:])


def run_dropout_bench(output_dir: str, steps: int | None, quick: bool) -> dict:
    from accel_train.tools.bench import machine_info

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    steps = steps or (3 if quick else 10)
    rows = []
    for name, make, batch, shape in workloads(quick):
        for compiled in (False, True):
            torchs = steps_per_s(make, batch, shape, False, compiled, steps, device)
            keyed = steps_per_s(make, batch, shape, True, compiled, steps, device)
            rows.append({"workload": name, "compiled": compiled, "torch_samples_per_s": torchs * batch,
                         "keyed_samples_per_s": keyed * batch, "keyed_over_torch": keyed / torchs})
            logger.info(f"bench --dropout: {name}{', compiled' if compiled else ''}: keyed {keyed * batch:.1f} "
                        f"samples/s, torch's {torchs * batch:.1f}: {keyed / torchs:.2f}x")
    result = {"device": device.type, "machine": machine_info(), "steps_per_window": steps, "rows": rows}
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_dropout.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
