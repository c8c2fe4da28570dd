"""accel-train: one training code path for one GPU, many GPUs and many machines, built on Accelerate.

The Python API (see accel_train/api.py): train, evaluate, predict, load_config; Task to subclass for your own
workload, Data (what a Task is given), mean_metric (an exact mean over the eval set), UserError (what a
mistake raises). Importing the package is light: torch loads when one of these is first used.
"""

from accel_train.console import print_lines_unless_told_otherwise

__version__ = "0.1.0"
__all__ = ["Config", "Data", "Task", "UserError", "evaluate", "load_config", "mean_metric", "predict", "train"]

_WHERE = {"train": "api", "evaluate": "api", "predict": "api", "load_config": "config", "Config": "config",
          "Task": "workloads.tasks", "mean_metric": "workloads.tasks", "Data": "data", "UserError": "errors"}


# the package's lines printed as the command line prints them, unless the program says otherwise (console.py)
print_lines_unless_told_otherwise()


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'accel_train' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"accel_train.{_WHERE[name]}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
