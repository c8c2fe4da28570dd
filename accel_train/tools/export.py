"""`accel-train export RUN output=DIR [format=library|onnx]`: a run's model as a folder its own library loads, with a
model card; publishing is the Hub's own `hf upload USER/NAME DIR` of that folder (docs/hub.md).

format=library (the default): an hf: model in save_pretrained's layout, id2label from classes.json and an image
processor that makes the inputs the run's evaluation made (transformers' pipeline("image-classification", model=DIR));
a timm: model in timm's own layout (timm.create_model("local-dir:DIR", pretrained=True)). format=onnx, for any model:
model.onnx (torch.onnx.export, a dynamic batch), checked against onnxruntime on a batch of the run's input shape before
it is kept (the largest difference of any output at most ONNX_TOLERANCE), with classes.json.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
import yaml
from packaging.version import Version

from accel_train.config import Config
from accel_train.errors import UserError, writing
from accel_train.import_paths import source_of
from accel_train.storage import refuse_no_folder
from accel_train.versions import check_versions

FORMATS = ("library", "onnx")
ONNX_TOLERANCE = 1e-4  # fp32 logits, onnxruntime's CPU kernels against torch's
WRITABLE = "give an output= folder you can write to"


def export_run(config: Config, checkpoint: str, output: str, format: str = "library") -> list[str]:
    """The model of the run at `checkpoint` (run_config's) written into the new folder `output`; the files."""
    from accel_train.data.predict_inputs import image_converter
    from accel_train.data.registry import Data
    from accel_train.run.weights import class_names, load_weights, read_weights, weights_file
    from accel_train.workloads.models import model_source
    from accel_train.workloads.tasks import task_named

    if format not in FORMATS:
        raise UserError(f"export: format={format}: choose one of {', '.join(FORMATS)}")
    source = model_source(config.model)
    if format == "library" and source is None:
        raise UserError(f"export: model.name={config.model.name} has no library of its own to load it (hf: and timm: "
                        "models do); give format=onnx, or use the run's model.safetensors as it is")
    folder = output_folder(output)
    task = task_named(config.task)
    task.check_config(config)
    classes = class_names(checkpoint, config.data.num_classes)
    shape = image_converter(config.data)[1]
    if format == "onnx" and shape is None:
        raise UserError(f"export: format=onnx needs the model's input shape, which data.name={config.data.name} does "
                        "not say without a sample; set data.image_size, or export from a recipe of the registry")
    data = Data(None, len(classes), shape or (), classes)
    task.setup(config, data)
    model = load_weights(task.build_model(config, data), read_weights(weights_file(checkpoint)), checkpoint,
                         f"model.name={config.model.name} on {config.data.name}").eval()
    with writing(folder, "exporting the model", WRITABLE):
        # staged under a name made for this export (nobody else's to lose), in the nearest folder that is there:
        # the folders output= names are made only once the export is whole
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.export-", dir=next(
            above for above in folder.parents if above.is_dir())))
    try:
        with writing(folder, "exporting the model", WRITABLE):
            if format == "onnx":
                onnx_model(model, shape, staging)
                (staging / "classes.json").write_text(json.dumps(classes, indent=1) + "\n")
            else:
                source.export(model, config.model, config.data, classes, staging)
            (staging / "README.md").write_text(model_card(config, checkpoint, format))
            folder.parent.mkdir(parents=True, exist_ok=True)
            if folder.is_dir():  # empty (output_folder): the export takes its place
                folder.rmdir()
            staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return sorted(path.name for path in folder.iterdir())


def output_folder(output: str) -> Path:
    """The new folder output= names (through a link to a folder: the folder it names), or one line: it holds files,
    or cannot be a folder (a file, a link to one or to nothing, a path below a file)."""
    refuse_no_folder(Path(output), f"export: output={output}")
    folder = Path(output).resolve() if Path(output).is_symlink() else Path(output)
    if folder.is_dir() and any(folder.iterdir()):
        raise UserError(f"export: output={output} holds files already; give a new folder")
    return folder


class Outputs(torch.nn.Module):
    """A model's outputs as tensors: an output object's logits (transformers'), else what it returns."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor):
        outputs = self.model(images)
        return outputs.logits if hasattr(outputs, "logits") else outputs


def onnx_model(model: torch.nn.Module, shape: tuple[int, ...], folder: Path) -> float:
    """model.onnx in `folder`, with a dynamic batch; the largest difference between onnxruntime's outputs and
    torch's on a batch of 3, which must be at most ONNX_TOLERANCE."""
    check_versions(("onnx",))
    if Version(torch.__version__.split("+")[0]) < Version("2.6"):
        raise UserError(f"export: format=onnx needs torch 2.6 or newer (its dynamo exporter); this is torch "
                        f"{torch.__version__}")
    try:
        import onnxruntime
    except ImportError:
        raise UserError("export: format=onnx needs onnx, onnxscript and onnxruntime: pip install "
                        "'accel-train[onnx]'") from None
    wrapped, example = Outputs(model).eval(), torch.randn(2, *shape, generator=torch.Generator().manual_seed(0))
    path = folder / "model.onnx"
    with torch.no_grad():
        large = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters()) > 2**30
        torch.onnx.export(wrapped, (example,), str(path), input_names=["pixel_values"], dynamo=True, verbose=False,
                          dynamic_shapes=({0: torch.export.Dim("batch")},), external_data=large)  # one file < 1 GiB
        checked = torch.randn(3, *shape, generator=torch.Generator().manual_seed(1))
        expected = wrapped(checked)
    expected = [expected] if torch.is_tensor(expected) else list(expected)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    found = session.run(None, {session.get_inputs()[0].name: checked.numpy()})
    largest = max(float((torch.from_numpy(got) - want).abs().max()) for got, want in zip(found, expected))
    if largest > ONNX_TOLERANCE:
        raise UserError(f"export: onnxruntime's outputs differ from torch's by up to {largest:.2e}, more than "
                        f"{ONNX_TOLERANCE:g}: this model does not export faithfully to ONNX")
    return largest


def model_card(config: Config, checkpoint: str, format: str) -> str:
    """README.md: what the model is, what it was trained on, its final metrics (metrics.jsonl) and its config."""
    from accel_train.run.layout import read_lines, run_of
    from accel_train.run.summaries import eval_metrics

    run = run_of(checkpoint)
    lines = read_lines(run) if run is not None else []
    final = next((line for line in reversed(lines) if line["split"] == "test"), None)
    model, data = config.model.name, config.data.name
    library = {"hf": "transformers", "timm": "timm"}.get(source_of(model) or "", None) if format == "library" else None
    def hub_name(name: str) -> str | None:  # a Hub repository's name, not a local folder's
        where = name.partition(":")[2]
        return where if source_of(name) == "hf" and not Path(where).expanduser().exists() else None

    front = {"library_name": library, "tags": ["image-classification", "accel-train"],
             "base_model": hub_name(model) if config.model.pretrained else None,
             "datasets": [hub_name(data)] if hub_name(data) else None,
             "metrics": [name for name in eval_metrics(final) if name not in ("num_samples", "correct")] if final
             else None}
    front = {key: value for key, value in front.items() if value}
    results = "\n".join(f"| {name} | {value:.4f} |" if isinstance(value, float) else f"| {name} | {value} |"
                        for name, value in eval_metrics(final).items()) if final else ""
    loads = {"transformers": "from transformers import pipeline\n\nclassify = pipeline(\"image-classification\", "
                             "model=\"THIS_FOLDER_OR_REPO\")",
             "timm": "import timm\n\nmodel = timm.create_model(\"local-dir:THIS_FOLDER\", pretrained=True)  "
                     "# or hf-hub:USER/NAME"}
    use = loads.get(library or "", "import onnxruntime\n\nsession = onnxruntime.InferenceSession(\"model.onnx\")")
    return (f"---\n{yaml.safe_dump(front, sort_keys=False)}---\n\n"
            f"# {model} on {data}\n\n"
            f"Trained with accel-train (Hugging Face Accelerate), exported from `{checkpoint}`: {config.train.epochs} "
            f"epoch(s), global batch {config.train.batch_size}, seed {config.seed}; inputs "
            f"{config.data.image_size or 'at their native size'} px.\n\n"
            + (f"## Results (step {final['step']}, {final['split']} split)\n\n| metric | value |\n|---|---|\n"
               f"{results}\n\n" if final else "")
            + f"## Use\n\n```python\n{use}\n```\n\n"
            f"## Training configuration\n\n```yaml\n{yaml.safe_dump(config.to_dict(), sort_keys=False)}```\n")
