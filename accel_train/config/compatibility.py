"""Run compatibility: the keys that decide what trained weights mean, and the refusal of settings that contradict
a run's (eval, predict and resume of its weights)."""

from __future__ import annotations

from typing import Any

from accel_train.config.overrides import spelled
from accel_train.config.schema import Config
from accel_train.config.trust import TRUST_KEYS
from accel_train.errors import UserError
from accel_train.import_paths import is_given_object

# Keys that decide what trained weights mean (model.* too): evaluating, predicting or resuming with another value
# would silently give other numbers, so a value that contradicts the run's is refused.
MEANING_KEYS = ("task", "data.name", "data.num_classes", "data.image_size", "data.normalize", "data.mean",
                "data.std", "data.channels", "data.crop_fraction", "data.interpolation")
STARTING_POINT = ("model.init_from",)  # where training started: not what the trained weights mean
# Left unset, these take the model's own values (workloads/inputs.py), which the run recorded: the same model.* gives
# them again, so unset is not a contradiction.
TAKEN_FROM_THE_MODEL = ("data.image_size", "data.mean", "data.std", "data.channels", "data.crop_fraction",
                        "data.interpolation")


def contradictions(recorded: dict, config: Config) -> list[tuple[str, Any, Any]]:
    """(key, recorded value, value in `config`) for each key that decides what trained weights mean
    (MEANING_KEYS, model.*) on which `config` differs from a run's recorded config. Keys the record lacks are not
    compared, nor those an object given in Python stands in for (<module.Class>): that object is the caller's to
    match."""
    def settings(tree: dict) -> dict[str, Any]:  # section.key -> value; a mapping such as model.args stays whole
        return {f"{name}.{key}" if isinstance(section, dict) else name: value
                for name, section in tree.items() if name != "run"
                for key, value in (section.items() if isinstance(section, dict) else [(None, section)])}

    saved, ours = settings(recorded), settings(config.to_dict())
    given = [value for value in ours.values() if isinstance(value, str) and is_given_object(value)]
    return [(key, saved[key], ours.get(key)) for key in saved
            if (key in MEANING_KEYS or key.startswith("model.")) and key not in STARTING_POINT
            and key not in TRUST_KEYS  # whose code may run: the command's word each time, not what weights mean
            and saved[key] != ours.get(key) and ours.get(key) not in given
            and not (ours.get(key) is None and key in TAKEN_FROM_THE_MODEL)]


def refuse_contradictions(recorded: dict, config: Config, what: str, remedy: str) -> None:
    """One line naming every contradicting key with both values, e.g. for `eval RECIPE checkpoint=RUN`."""
    found = contradictions(recorded, config)
    if found:
        listed = ", ".join(f"{key}={spelled(ours)} (trained with {spelled(saved)})" for key, saved, ours in found)
        raise UserError(f"{what}: {listed}; {remedy}")
