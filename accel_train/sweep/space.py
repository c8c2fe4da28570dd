"""The search space, as the command line gives it: `KEY=DISTRIBUTION(ARGS)` beside fixed `KEY=VALUE` overrides.

Checked against the config before any trial starts, by loading the recipe with each parameter at its ends (each
choice, for `choice`): an unknown key, a value the key cannot take and a range with low >= high are one line.
No Optuna and no torch here. Written by hand: Optuna has no text form of its distributions for a command line.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import yaml

from accel_train.config import Config, load_config
from accel_train.config import spelled as spell  # a value as an override takes it: null, true, 0.001
from accel_train.errors import UserError

# name: (what it samples, number of arguments); choice takes any number of values
DISTRIBUTIONS = {
    "uniform": "a float between low and high",
    "loguniform": "a float between low and high, uniform in log space (learning rates, weight decay)",
    "int": "an integer between low and high, both included",
    "logint": "an integer between low and high, both included, uniform in log space (widths, batch sizes)",
    "choice": "one of the values given",
}
_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
_CALL = re.compile(r"^([A-Za-z_]\w*)\((.*)\)$", re.DOTALL)


@dataclass(frozen=True)
class Parameter:
    key: str  # a config key, e.g. train.lr
    distribution: str  # one of DISTRIBUTIONS
    values: tuple  # (low, high), or the choices

    @property
    def spelled(self) -> str:
        """As the command line gives it: train.lr=loguniform(0.0001,0.1)."""
        return f"{self.key}={self.distribution}({','.join(spell(value) for value in self.values)})"

    @property
    def ends(self) -> tuple:
        """The values the config is checked with before any trial: both ends, or every choice."""
        return self.values

    @property
    def log(self) -> bool:
        return self.distribution.startswith("log")


def is_parameter(override: str) -> bool:
    """`train.lr=loguniform(1e-4,1e-1)` is searched; `train.lr=0.01` is fixed."""
    return bool(_CALL.match(override.partition("=")[2].strip()))


def parse_space(overrides: list[str]) -> tuple[list[Parameter], list[str]]:
    """(the searched parameters, the fixed overrides) of the command line's KEY=VALUE arguments."""
    parameters, fixed = [], []
    for override in overrides:
        key, sep, raw = override.partition("=")
        if not sep or not key.strip():
            raise UserError(f"sweep: '{override}' is not of the form KEY=VALUE or KEY=DISTRIBUTION(ARGS), e.g. "
                            "'train.lr=loguniform(1e-4,1e-1)'")
        if is_parameter(override):
            parameters.append(parameter(key.strip(), raw.strip()))
        else:
            fixed.append(override)
    keys = [p.key for p in parameters]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise UserError(f"sweep: {', '.join(twice)} searched twice; give each parameter once")
    both = [p.key for p in parameters if any(o.partition("=")[0].strip() == p.key for o in fixed)]
    if both:
        raise UserError(f"sweep: {', '.join(both)} both searched and fixed; give it once")
    if not parameters:
        raise UserError("sweep: nothing to search; give at least one KEY=DISTRIBUTION(ARGS), e.g. "
                        f"'train.lr=loguniform(1e-4,1e-1)' (distributions: {', '.join(DISTRIBUTIONS)})")
    return parameters, fixed


def parameter(key: str, raw: str) -> Parameter:
    name, text = _CALL.match(raw).groups()
    given = f"{key}={raw}"
    if name not in DISTRIBUTIONS:
        raise UserError(f"sweep: unknown distribution '{name}' in {given}; choose one of "
                        + "; ".join(f"{n} ({what})" for n, what in DISTRIBUTIONS.items()))
    try:
        values = tuple(_number_or_text(value) for value in yaml.safe_load(f"[{text}]"))
    except yaml.YAMLError:
        raise UserError(f"sweep: {given}: the arguments are not values separated by commas") from None
    if name == "choice":
        if len(values) < 2 or len(set(map(repr, values))) < len(values):
            raise UserError(f"sweep: {given}: choice takes two or more different values, e.g. choice(64,128,256)")
        if not all(value is None or isinstance(value, (bool, int, float, str)) for value in values):
            raise UserError(f"sweep: {given}: a choice is among plain values (numbers, text, true/false, null)")
        return Parameter(key, name, values)
    whole = name in ("int", "logint")
    if len(values) != 2 or not all(_is_number(value, whole) for value in values):
        kind = "integers" if whole else "numbers"
        raise UserError(f"sweep: {given}: {name} takes two {kind}, low and high, e.g. {key}={name}"
                        f"({'8,64' if whole else '1e-4,1e-1' if name == 'loguniform' else '0,0.2'})")
    low, high = values
    if low >= high:
        raise UserError(f"sweep: {given}: low ({spell(low)}) must be below high ({spell(high)})")
    if name.startswith("log") and low <= 0:
        raise UserError(f"sweep: {given}: {name} needs low above 0 (a logarithm), got {spell(low)}")
    return Parameter(key, name, (low, high))


def _number_or_text(value: Any) -> Any:
    """1e-4 is a number here, though YAML 1.1 (PyYAML) reads a float without a dot as text."""
    if isinstance(value, str):
        try:
            return float(value) if _FLOAT.match(value.strip()) else value
        except ValueError:
            return value
    return value


def _is_number(value: Any, whole: bool) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return isinstance(value, int) if whole else True


def check_space(recipe: str, parameters: list[Parameter], fixed: list[str]) -> Config:
    """Before any trial: the fixed settings load, and every searched key exists and takes every value the sweep
    may give it (the config's own checks, with the parameter at each end and the others at their lows), so no
    trial fails on a typo. Returns the recipe with the fixed settings."""
    try:
        config = load_config(recipe, fixed)
    except UserError as err:
        raise UserError(f"sweep: {err}") from None
    base = [f"{p.key}={spell(p.values[0])}" for p in parameters]
    for index, searched in enumerate(parameters):
        for value in searched.ends:
            try:
                load_config(recipe, [*fixed, *base[:index], f"{searched.key}={spell(value)}", *base[index + 1:]])
            except UserError as err:
                raise UserError(f"sweep: {searched.spelled}: {err}") from None
        if searched.distribution in ("uniform", "loguniform"):  # a float between two integers: an int key refuses it
            between = math.nextafter(float(searched.values[0]), float(searched.values[1]))
            try:
                load_config(recipe, [*fixed, *base[:index], f"{searched.key}={between!r}", *base[index + 1:]])
            except UserError:
                raise UserError(f"sweep: {searched.spelled}: {searched.key} takes integers; search it with "
                                f"int(...), logint(...) or choice(...)") from None
    return config
