"""The run configuration: a tree of typed dataclasses (schema.py), loaded from a YAML recipe (recipes.py) plus
dotted overrides (overrides.py), and checked against a run's own (compatibility.py)."""

from accel_train.config.compatibility import MEANING_KEYS, contradictions, refuse_contradictions
from accel_train.config.overrides import flatten, spelled
from accel_train.config.recipes import CONFIG_FILE, RECIPES_DIR, list_recipes, load_config, save_config
from accel_train.config.schema import (
    MAX_IMAGE_PIXELS,
    SHARD_ORDER_KEYS,
    CheckpointConfig,
    Config,
    DataConfig,
    ModelConfig,
    PredictConfig,
    TrainConfig,
    describe_keys,
)

__all__ = ["CONFIG_FILE", "MAX_IMAGE_PIXELS", "MEANING_KEYS", "RECIPES_DIR", "SHARD_ORDER_KEYS", "CheckpointConfig",
           "Config", "DataConfig", "ModelConfig", "PredictConfig", "TrainConfig", "contradictions", "describe_keys",
           "flatten", "list_recipes", "load_config", "refuse_contradictions", "save_config", "spelled"]
