"""Image classification: cross-entropy, top-1 / top-5 accuracy and mean loss over exactly the eval set."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from accel_train.config import Config
from accel_train.data import ImageData
from accel_train.tasks.base import TASKS, Task, WithComputeArgs


@TASKS.register("classification")
class ClassificationTask(Task):
    top_k = 5
    report_top5 = True  # until build_model knows the number of classes

    def check_config(self, config: Config) -> None:
        from accel_train.data import DATASETS
        from accel_train.models import check_model_name

        DATASETS.get(config.data.name)
        check_model_name(config.model.name)

    def build_model(self, config: Config, data: ImageData) -> nn.Module:
        from accel_train.models import build_classifier

        self.report_top5 = data.num_classes > self.top_k
        return build_classifier(config.model, data.num_classes, data.image_shape)

    def training_step(self, model, batch):
        images, labels = batch
        return {"loss": F.cross_entropy(model(images), labels)}

    def eval_step(self, model, batch):
        images, labels = batch
        logits = model(images)
        k = min(self.top_k, logits.shape[-1])
        return {
            "predictions": logits.topk(k, dim=-1).indices,
            "references": labels,
            "losses": F.cross_entropy(logits.float(), labels, reduction="none"),
        }

    def new_metric(self):
        from accel_train.metrics import ClassificationMetrics, in_memory

        return WithComputeArgs(in_memory(ClassificationMetrics), report_top5=self.report_top5)
