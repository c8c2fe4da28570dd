#!/usr/bin/env python3
"""`make gpu-bench`: the speed questions only a GPU answers, as one table, in at most 8 minutes (beside `make
gpu-check`, which judges correctness). Prepare here, run there, from the repo root:

    make gpu-wheels gpu-data   # here: .gpu-wheels/ (as for gpu-check), .gpu-data/ (Fashion-MNIST, photographs)
    make gpu-bench             # there: python3 tools/gpu_bench.py

Rows, each under its own cap (CAPS), printed as a table and written to OUT/gpu_bench.json (OUT: --out, default
runs/gpu-bench/; and to $OUT/ too when that variable is set), each row's commands and output in OUT/logs/ROW.log:

- small_models: our loop against a plain PyTorch loop on the demo CNN at batch 64 and 256 (the launch-bound case:
  a step is a few dozen kernel launches and Python), and train.compile=true at 64 (goal: ours >= 0.95 of plain).
- time_to_accuracy: fashion_mnist_fast to its end on the real Fashion-MNIST: test accuracy, the training's wall
  time and its curve (goal: 93.4% in under 10 s of training on an H100).
- resnet18_flops: ResNet-18 at 224 px, bf16, channels_last: achieved training FLOP/s against the card's bf16 peak
  (--peak-tflops, else a measured bf16 matmul) (goal >= 35%).
- jpeg_decoding: JPEG photographs decoded on one CPU core (libjpeg-turbo, as our workers do) against nvJPEG on the
  GPU in batches (torchvision.io.decode_jpeg(device="cuda")): images/s each, the case for data.decode=device.
- jpeg_end_to_end: ResNet-50, bf16, 224 px from the JPEG folder with 4 DataLoader workers: samples/s and the share
  of the time waiting for data (goal: at most 5%, at the raw shards' figure).
- vit_b16_peer: `accel-train bench --hub` on a ViT-B/16 (transformers' ViTConfig, freshly initialised): accel-train
  against Hugging Face's own example loop, the same hf: data.

`--dry-run` runs every row on the CPU with tiny sizes (the suite does: tests/tools/test_gpu_bench.py), so that no
row's command rots between visits to a GPU; no number of a dry run is judged against a goal.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import shutil
import sys
import time
from pathlib import Path

import gpu_check  # beside this file (tools/, the first entry of sys.path when it runs as a script)

REPO = Path(__file__).resolve().parents[1]
Check, Failed, accel_train, run_info = gpu_check.Check, gpu_check.Failed, gpu_check.accel_train, gpu_check.run_info

PYTHON = sys.executable
BUDGET_S = 480
# Rows in order, each with its cap in seconds on the GPU (they add up to less than BUDGET_S) and in the dry run.
CAPS = {
    "install": (35, 150),
    "small_models": (80, 300),
    "time_to_accuracy": (120, 300),
    "resnet18_flops": (60, 300),
    "jpeg_decoding": (30, 200),
    "jpeg_end_to_end": (60, 300),
    "vit_b16_peer": (80, 400),
}
GOALS = {"small_models_ratio": 0.95, "fashion_mnist_accuracy": 0.934, "fashion_mnist_train_s": 10.0,
         "resnet18_utilisation": 0.35, "jpeg_data_wait": 0.05}
BF16_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense, from NVIDIA's data sheets


GPU_DATA = REPO / ".gpu-data"  # make gpu-data: Fashion-MNIST's .gz files and a folder of photographs


def bench_overhead(check: Check, name: str, batch: int, *extra: str) -> dict:
    run = check.folder(name)
    sizes = ["--steps", "1"] if check.dry_run else ["--steps", "200"]
    check.run(accel_train("bench", "--overhead", "--quick", *sizes, "fashion_mnist_cnn", "data.synthetic=true",
                          f"train.batch_size={8 if check.dry_run else batch}", *extra, f"output_dir={run}"),
              env={"TORCH_COMPILE_DISABLE": "1"} if check.dry_run and extra else None)
    return json.loads((run / "bench.json").read_text())["overhead"]


def small_models(check: Check) -> None:
    row = check.row
    for batch in (64, 256):
        overhead = bench_overhead(check, f"small_models_{batch}", batch)
        row.numbers[f"ratio_{batch}"] = overhead["ratio"]
        row.numbers[f"ours_samples_per_s_{batch}"] = overhead["ours_samples_per_s"]
    compiled = bench_overhead(check, "small_models_64_compiled", 64, "train.compile=true")
    row.numbers["compiled_ratio_64"] = compiled["ratio"]
    row.note = "CUDA graphs: no switch of ours yet (train.compile uses inductor's default mode)"
    if check.dry_run:
        row.note = "dry run: ratios not judged on CPU; compile disabled (TORCH_COMPILE_DISABLE=1)"
    elif min(row.numbers["ratio_64"], row.numbers["ratio_256"]) < GOALS["small_models_ratio"]:
        raise Failed(f"our loop at {row.numbers['ratio_64']:.3f} (64) and {row.numbers['ratio_256']:.3f} (256) of the "
                     f"plain loop; goal {GOALS['small_models_ratio']}")


def fashion_mnist_root(check: Check) -> Path:
    """Fashion-MNIST unpacked where torchvision reads it (OUT/data/FashionMNIST/raw), from .gpu-data/fashion-mnist
    or Debian's /usr/share/datasets/fashion-mnist."""
    sources = [GPU_DATA / "fashion-mnist", Path("/usr/share/datasets/fashion-mnist")]
    source = next((path for path in sources if list(path.glob("*-ubyte.gz"))), None)
    if source is None:
        raise Failed(f"no Fashion-MNIST in {' or '.join(map(str, sources))} (make gpu-data)")
    root = check.out / "data"
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for packed in source.glob("*-ubyte.gz"):
        if not (raw / packed.stem).exists():
            with gzip.open(packed, "rb") as src, open(raw / packed.stem, "wb") as dst:
                shutil.copyfileobj(src, dst)
    return root


def time_to_accuracy(check: Check) -> None:
    run = check.folder("time_to_accuracy")
    sizes = ["train.epochs=1", "data.train_subset=512", "data.eval_subset=256", "train.batch_size=64",
             "train.warmup_steps=2", "train.log_every_steps=2"] if check.dry_run else []
    check.run(accel_train("train", "fashion_mnist_fast", f"data.root={fashion_mnist_root(check)}", *sizes,
                          "train.plot=false", "train.progress_bar=false", f"output_dir={run}"),
              env={"ACCELERATE_MIXED_PRECISION": "bf16"})
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evaluations = [line for line in lines if line.get("split") in ("val", "test") and "accuracy" in line]
    if not evaluations:
        raise Failed("no evaluation with an accuracy in metrics.jsonl")
    final = evaluations[-1]
    check.row.numbers.update(accuracy=final["accuracy"], split=final["split"], train_s=final["elapsed_s"],
                             device=run_info(run)["device"],
                             curve=[round(line["accuracy"], 4) for line in evaluations])
    if check.dry_run:
        check.row.note = "dry run: 512 samples, one epoch; not judged"
    elif final["accuracy"] < GOALS["fashion_mnist_accuracy"]:
        raise Failed(f"{final['accuracy']:.2%} test accuracy; goal {GOALS['fashion_mnist_accuracy']:.1%}")


FLOPS = """
import json, sys
from accel_train.config import load_config
from accel_train.tools.bench import flops
config = load_config("stl10_resnet18", sys.argv[3:])
peak = float(sys.argv[2]) if sys.argv[2] != "measure" else None
print(json.dumps(flops(config, float(sys.argv[1]), peak, True, print)))
"""


def resnet18_flops(check: Check) -> None:
    """A short bf16 run's samples/s, times the training FLOPs of a sample (bench's FlopCounterMode count)."""
    run = check.folder("resnet18_flops")
    sizes = ["model.name=bn_cnn", "data.image_size=32", "train.batch_size=8"] if check.dry_run else \
        ["data.image_size=224", "train.batch_size=256"]
    steps = ["train.max_steps=4", "train.log_every_steps=2"] if check.dry_run else \
        ["train.max_steps=60", "train.log_every_steps=20"]
    check.run(accel_train("train", "stl10_resnet18", "data.synthetic=true", "train.channels_last=true", *sizes,
                          *steps, f"data.train_subset={64 if check.dry_run else 256 * 62}", "train.epochs=1000",
                          "checkpoint.at_epoch_end=false", "train.plot=false", "train.progress_bar=false",
                          f"output_dir={run}"), env={"ACCELERATE_MIXED_PRECISION": "bf16"})
    peak = next((value for name, value in BF16_PEAK_TFLOPS.items() if name in gpu_name()), None)
    said = check.run([PYTHON, "-c", FLOPS, str(gpu_check.samples_per_s(run)),
                      "1" if check.dry_run else str(peak or "measure"), "data.synthetic=true", *sizes]).stdout
    flops = json.loads(said.strip().splitlines()[-1])
    check.row.numbers.update(achieved_tflops=flops["achieved_tflops"], peak_tflops=flops["peak_tflops"],
                             peak_source=flops["peak_source"], utilisation=flops["utilisation"])
    if check.dry_run:
        check.row.note = "dry run: a small CNN on the CPU against a peak of 1 TFLOP/s; not judged"
    elif flops["utilisation"] < GOALS["resnet18_utilisation"]:
        raise Failed(f"{flops['utilisation']:.1%} of the bf16 peak; goal {GOALS['resnet18_utilisation']:.0%}")


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def photographs(check: Check) -> Path:
    """.gpu-data/photos (make gpu-data), else a folder `accel-train photos` makes here (needs mate-backgrounds)."""
    staged = GPU_DATA / "photos"
    if (staged / "train").is_dir():
        return staged
    made = check.out / "photos"
    check.run(accel_train("photos", str(made), "--train", "64", "--test", "16"))
    return made


JPEG_DECODING = """
import sys, time, torch
from pathlib import Path
from torchvision.io import decode_jpeg
files = sorted(Path(sys.argv[1]).glob("train/*/*.jpg"))[:int(sys.argv[2])]
data = [torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8) for path in files]
torch.set_num_threads(1)
started = time.perf_counter()
for encoded in data:
    decode_jpeg(encoded)
print("cpu_one_core", len(data) / (time.perf_counter() - started))
if torch.cuda.is_available():
    for _ in range(2):  # the first batch starts nvJPEG
        torch.cuda.synchronize(); started = time.perf_counter()
        for first in range(0, len(data), 128):
            decode_jpeg(data[first:first + 128], device="cuda")
        torch.cuda.synchronize()
    print("gpu_batched", len(data) / (time.perf_counter() - started))
"""


def jpeg_decoding(check: Check) -> None:
    said = check.run([PYTHON, "-c", JPEG_DECODING, str(photographs(check)), "32" if check.dry_run else "2000"]).stdout
    rates = {name: float(value) for name, value in re.findall(r"^(\w+) ([\d.]+)$", said, re.MULTILINE)}
    check.row.numbers.update(rates)
    if "cpu_one_core" not in rates or (not check.dry_run and "gpu_batched" not in rates):
        raise Failed(f"no decoding rate printed: {gpu_check.last_line(said)}")
    if "gpu_batched" in rates:
        check.row.numbers["gpu_over_one_core"] = rates["gpu_batched"] / rates["cpu_one_core"]
    check.row.note = "data.decode=device not built yet: this is its ceiling" if not check.dry_run else \
        "dry run: the CPU's decode only"


def jpeg_end_to_end(check: Check) -> None:
    run = check.folder("jpeg_end_to_end")
    sizes = ["model.name=bn_cnn", "data.image_size=32", "train.batch_size=8", "train.max_steps=4",
             "train.log_every_steps=2", "data.num_workers=2"] if check.dry_run else \
        ["data.image_size=224", "train.batch_size=256", "train.max_steps=60", "train.log_every_steps=20",
         "data.num_workers=4", "train.channels_last=true"]
    check.run(accel_train("train", "imagefolder", f"data.root={photographs(check)}", "model.name=resnet50", *sizes,
                          "data.augment=true", "train.epochs=1000", "checkpoint.at_epoch_end=false",
                          "train.plot=false", "train.progress_bar=false", f"output_dir={run}"),
              env={"ACCELERATE_MIXED_PRECISION": "bf16"})
    lines = gpu_check.train_lines(run)
    best = max(lines[1:] or lines, key=lambda line: line.get("samples_per_s", 0))
    check.row.numbers.update(samples_per_s=best.get("samples_per_s"), data_wait=best.get("data_wait"),
                             device=run_info(run)["device"])
    if check.dry_run:
        check.row.note = "dry run: a small CNN at 32 px; not judged"
    elif (best.get("data_wait") or 0) > GOALS["jpeg_data_wait"]:
        check.row.note = f"waiting {best['data_wait']:.0%} for data; goal at most {GOALS['jpeg_data_wait']:.0%}"


VIT_B16 = """
import sys
from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor
config = ViTConfig(num_labels=10) if sys.argv[2] == "base" else ViTConfig(
    num_labels=10, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32,
    patch_size=16)
ViTForImageClassification(config).save_pretrained(sys.argv[1])
ViTImageProcessor(size={"height": config.image_size, "width": config.image_size}).save_pretrained(sys.argv[1])
"""


def vit_b16_peer(check: Check) -> None:
    found = check.run([PYTHON, "-c", "import importlib.util as u; print(bool(u.find_spec('transformers')))"]).stdout
    if "True" not in found:
        raise Failed("transformers is not installed here (accel-train[hub]); add it to make gpu-wheels' pins")
    model = check.folder("vit_b16_peer") / "vit"
    check.run([PYTHON, "-c", VIT_B16, str(model), "tiny" if check.dry_run else "base"])
    run = check.folder("vit_b16_peer_runs")
    steps = ["--steps", "2"] if check.dry_run else []
    settings = ["train.batch_size=4", "data.num_workers=0"] if check.dry_run else \
        ["train.batch_size=128", "data.num_workers=4"]
    said = check.run(accel_train("bench", "--hub", *steps, "hf_image_classification", f"model.name=hf:{model}",
                                 f"data.name=hf:{photographs(check)}", *settings, f"output_dir={run}"),
                     env={"ACCELERATE_MIXED_PRECISION": "bf16"}).stdout
    result = json.loads((run / "bench_hub.json").read_text())
    check.row.numbers.update(ratio=result["ratio"], ours_samples_per_s=result["ours_samples_per_s"],
                             example_samples_per_s=result["example_samples_per_s"],
                             data_wait=result["ours_data_wait"])
    if check.dry_run:
        check.row.note = "dry run: a one-layer ViT at 32 px; not judged"
    elif "bench --hub:" not in said:
        raise Failed("bench --hub printed no result line")


ROWS = [gpu_check.install, small_models, time_to_accuracy, resnet18_flops, jpeg_decoding, jpeg_end_to_end,
        vit_b16_peer]


def main(argv: list[str] | None = None) -> int:
    parser = gpu_check.OneLineErrors(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="every row on the CPU, tiny sizes")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu-bench", help="runs, logs, site, JSON")
    parser.add_argument("--wheels", type=Path, default=REPO / ".gpu-wheels", help="wheels made by make gpu-wheels")
    parser.add_argument("--only", help="comma-separated rows to run (install always runs)")
    args = parser.parse_args(argv)
    unknown = [name.strip() for name in (args.only or "").split(",") if name.strip() and name.strip() not in CAPS]
    if unknown:
        parser.error(f"--only {args.only}: no row named {', '.join(unknown)}; the rows are {', '.join(CAPS)}")
    started = time.monotonic()
    out = args.out.resolve()
    shutil.rmtree(out / "logs", ignore_errors=True)
    check = Check(args.dry_run, out, args.wheels.resolve(), caps=CAPS, budget_s=BUDGET_S)
    rows = gpu_check.run_rows(check, ROWS, args.only, started, "gpu-bench")
    print(gpu_check.table(rows), flush=True)
    path = out / "gpu_bench.json"
    result = gpu_check.write_json(rows, path, args.dry_run, started)
    result.update(goals=GOALS, card=gpu_name())
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"gpu-bench: {'dry run, ' if args.dry_run else ''}{len(rows)} rows in {result['seconds']:.0f} s on "
          f"{result['card']}; {'all ok' if result['ok'] else 'failed: ' + ', '.join(result['failed'])}; table in "
          f"{path}, logs in {out / 'logs'}", flush=True)
    gpu_check.bring_back(path, out / "logs", "gpu_bench")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
