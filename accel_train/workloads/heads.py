"""A pretrained model's output layer replaced by a new one for the run's classes: torchvision's models by name and
hf: models whose saved labels are others share it."""

from __future__ import annotations

from torch import nn

from accel_train.errors import UserError


def replace_head(model: nn.Module, pretrained_classes: int, num_classes: int) -> nn.Module:
    """Replace the last layer that outputs the weights' classes (Linear, or 1x1 Conv2d as in SqueezeNet) by a new
    one for `num_classes`, initialised as torchvision initialises a fresh one. Returns the new layer."""
    found = [(name, module) for name, module in model.named_modules()
             if (isinstance(module, nn.Linear) and module.out_features == pretrained_classes)
             or (isinstance(module, nn.Conv2d) and module.out_channels == pretrained_classes)]
    if not found:
        raise UserError(f"model.pretrained=true: no output layer of {pretrained_classes} classes found in "
                        f"{type(model).__name__} to replace by one of {num_classes}")
    name, old = found[-1]
    if isinstance(old, nn.Linear):
        new = nn.Linear(old.in_features, num_classes, bias=old.bias is not None)
    else:
        new = nn.Conv2d(old.in_channels, num_classes, old.kernel_size, old.stride, old.padding,
                        bias=old.bias is not None)
    parent_name, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attribute, new)
    return new
