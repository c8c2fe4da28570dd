"""Image classification: cross-entropy, top-1 / top-5 accuracy and mean loss over exactly the eval set."""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F

from accel_train.config import Config
from accel_train.data import Data
from accel_train.errors import UserError
from accel_train.workloads.mixing import BatchMixer
from accel_train.workloads.tasks.base import TASKS, Task, WithComputeArgs


@TASKS.register("classification")
class ClassificationTask(Task):
    top_k = 5
    metrics = {"accuracy": "max", "top5": "max", "loss": "min"}  # top5 with more than 5 classes
    report_top5 = True  # setup knows the number of classes
    predict_top_k = 1
    label_smoothing = 0.0
    mixer = None

    def setup(self, config: Config, data: Data) -> None:
        if data.num_classes is None:
            raise UserError(f"data.name={config.data.name}: the dataset gives no classes (no `classes` attribute); "
                            "set data.num_classes")
        self.report_top5 = data.num_classes > self.top_k
        self.label_smoothing = config.train.label_smoothing
        self.predict_top_k = min(config.predict.top_k, data.num_classes)
        cfg = config.train
        if cfg.mixup_alpha or cfg.cutmix_alpha:
            self.mixer = BatchMixer(data.num_classes, config.seed, cfg.mixup_alpha, cfg.cutmix_alpha, cfg.mix_prob,
                                    cfg.mix_switch_prob)
        if data.example is not None and not _is_classification_sample(data.example):
            sample = data.example
            shown = type(sample).__name__ if not isinstance(sample, (tuple, list)) else \
                "(" + ", ".join(type(part).__name__ for part in sample) + ")"
            raise UserError(f"data.name={config.data.name}: a sample is {shown}; task=classification needs "
                            "(input tensor, integer label)")

    def mix_batch(self, batch, epoch, number):
        return self.mixer(batch, epoch, number) if self.mixer else batch

    def training_step(self, model, batch):
        images, labels = batch  # labels: class indices, or class probabilities from MixUp / CutMix
        return {"loss": F.cross_entropy(logits_of(model(images)), labels, label_smoothing=self.label_smoothing)}

    def eval_step(self, model, batch):
        images, labels = batch
        logits = logits_of(model(images))
        k = min(self.top_k, logits.shape[-1])
        return {
            "predictions": logits.topk(k, dim=-1).indices,
            "references": labels,
            "losses": F.cross_entropy(logits.float(), labels, reduction="none"),
        }

    def new_metric(self):
        from accel_train.workloads.metrics import ClassificationMetrics, in_memory

        return WithComputeArgs(in_memory(ClassificationMetrics), report_top5=self.report_top5)

    def predict_step(self, model, inputs):
        scores, labels = logits_of(model(inputs)).float().softmax(dim=-1).topk(self.predict_top_k, dim=-1)
        return {"labels": labels, "scores": scores}


def logits_of(outputs) -> torch.Tensor:
    """The logits of what a model returns: a tensor, or an output object with `logits` (transformers' models)."""
    return outputs if torch.is_tensor(outputs) else outputs.logits


def _is_classification_sample(sample) -> bool:
    if not isinstance(sample, (tuple, list)) or len(sample) != 2 or not torch.is_tensor(sample[0]):
        return False
    label = sample[1]
    if torch.is_tensor(label):
        return label.ndim == 0 and not label.is_floating_point() and not label.is_complex()
    return isinstance(label, numbers.Integral) and not isinstance(label, bool)  # int or a NumPy integer
