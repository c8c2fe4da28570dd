"""Labels by name: an evaluation split's labels index the run's classes (the training split's names, classes.json),
whatever names its own folders or index list, and in whatever order. A split indexed on its own would shift every
label after a class it lacks, and report a wrong accuracy without a word."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch.utils.data import Dataset

from accel_train.data.registry import Data
from accel_train.errors import DataNotFoundError


def label_indices(own: Sequence[str], classes: Sequence[str], where: str) -> list[int]:
    """The run's index of each of a split's own class names; one line naming those the run never trained on."""
    position = {name: index for index, name in enumerate(classes)}
    unknown = [name for name in own if name not in position]
    if unknown:
        them = "them" if len(unknown) > 1 else "it"
        shown = ", ".join(repr(name) for name in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5
                                                                  else "")
        raise DataNotFoundError(f"{where} has class{'es' if len(unknown) > 1 else ''} {shown}, which the run never "
                                f"trained on (its {len(classes)} classes: {', '.join(classes[:10])}"
                                f"{', ...' if len(classes) > 10 else ''}); remove {them} from the evaluation data, or "
                                f"train on data that has {them}")
    return [position[name] for name in own]


def labelled_by(data: Data, classes: Sequence[str] | None, where: str) -> Data:
    """`data` (an evaluation split) with labels that index `classes` by name; as it is where it names no classes, or
    the same ones in the same order."""
    if classes is None or data.classes is None or list(data.classes) == list(classes):
        return data
    mapping = label_indices(data.classes, classes, where)
    num_classes = len(classes) if data.num_classes in (None, len(data.classes)) else data.num_classes
    return dataclasses.replace(data, dataset=Relabelled(data.dataset, mapping), classes=list(classes),
                               num_classes=num_classes)


class Relabelled(Dataset):
    """A dataset's samples with each label `mapping[label]`; what the loaders ask of the dataset (its transform, the
    generators it draws from, its collate_fn) is the dataset's own."""

    def __init__(self, dataset: Dataset, mapping: list[int]) -> None:
        self.dataset, self.mapping = dataset, mapping

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        inputs, label, *rest = self.dataset[index]
        return (inputs, self.mapping[int(label)], *rest)

    def __getattr__(self, name: str):
        if name in ("dataset", "mapping"):  # not yet set (copy, unpickling in a worker): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)
