"""Tasks by name: a Task owns what differs between workloads (model, forward + loss, metrics), so every workload
shares one loop. Each module here registers its tasks on import; a user's Task comes by import path."""

from accel_train.workloads.tasks import classification, vae  # noqa: F401  (registration)
from accel_train.workloads.tasks.base import TASKS, Task, check_task, mean_metric, task_named

__all__ = ["TASKS", "Task", "check_task", "mean_metric", "task_named"]
