"""Evaluation metrics as `evaluate` modules defined here (hub-loaded metrics fail offline).

They are fed per batch with tensors already passed through `accelerator.gather_for_metrics`, so every
process holds the complete, de-duplicated evaluation set and computes the same numbers.
"""

from __future__ import annotations

import datasets
import evaluate
import numpy as np

from accel_train.errors import storage_error

_CITATION = ""


def in_memory(metric_class: type[evaluate.Metric], *args) -> evaluate.Metric:
    """A metric that keeps its data in memory; evaluate still makes a folder for it in the Hugging Face cache."""
    try:
        return metric_class(*args, keep_in_memory=True)
    except OSError as err:
        raise storage_error(err.filename or "the Hugging Face cache", "creating an evaluate metric", err,
                            "set HF_HOME to a folder you can write (evaluate keeps its metric files there)") from None


class ClassificationMetrics(evaluate.Metric):
    """Top-1 and top-k accuracy plus mean cross-entropy over exactly the evaluated samples."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="top-1 / top-k accuracy and mean loss",
            citation=_CITATION,
            inputs_description="predictions: top-k class indices per sample (best first); references: true class; "
                               "losses: per-sample cross-entropy",
            features=datasets.Features({
                "predictions": datasets.Sequence(datasets.Value("int64")),
                "references": datasets.Value("int64"),
                "losses": datasets.Value("float64"),
            }),
        )

    def _compute(self, predictions, references, losses, report_top5: bool = True) -> dict:
        predictions, references = np.asarray(predictions), np.asarray(references)
        hits = predictions == references[:, None]
        result = {
            "num_samples": int(len(references)),
            "loss": float(np.mean(losses)),
            "accuracy": float(hits[:, 0].mean()),
            "correct": int(hits[:, 0].sum()),
        }
        if report_top5:
            result["top5"] = float(hits[:, :5].any(axis=1).mean())
        return result


class MeanValues(evaluate.Metric):
    """Per-sample values (e.g. loss terms) averaged over exactly the evaluated samples."""

    def __init__(self, names: tuple[str, ...], **kwargs) -> None:
        self.names = tuple(names)
        super().__init__(**kwargs)

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="mean of named per-sample values",
            citation=_CITATION,
            inputs_description="one float per sample for each named value",
            features=datasets.Features({name: datasets.Value("float64") for name in self.names}),
        )

    def _compute(self, **columns) -> dict:
        first = next(iter(columns.values()))
        return {"num_samples": len(first), **{name: float(np.mean(values)) for name, values in columns.items()}}
