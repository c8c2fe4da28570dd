"""accel-train: one training code path for one GPU, many GPUs and many machines, built on Accelerate."""

__version__ = "0.1.0"
