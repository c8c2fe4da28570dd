"""Contracts of the other libraries' underscore names the package uses: each one is a row of docs/tests.md's
"Borrowed internals" (why, and the tests that fail when a release renames it), every row is still used, and each
name kept is still where the installed library keeps it."""

import ast
import functools
import importlib
import inspect
import os
import re
import sys
import threading
from pathlib import Path

import pytest

from support.locations import REPO, is_defined, named_tests

PACKAGE = REPO / "accel_train"
TABLE = (REPO / "docs" / "tests.md").read_text().split("## Borrowed internals")[1].split("\n## ")[0]


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name.strip("_") != ""


def listed() -> set[tuple[str, str]]:
    """(file, name) for every name and file of a row of the table."""
    rows = [line.split(" | ") for line in TABLE.splitlines() if line.startswith("| ") and "`accel_train/" in line]
    return {(file, name) for row in rows for name in re.findall(r"`(?:[\w.]+\.)?(_\w+)`", row[1])
            for file in re.findall(r"`(accel_train/[\w/]+\.py)`", row[2])}


def parsed() -> dict[str, ast.Module]:
    return {str(path.relative_to(REPO)): ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


def own_names(trees: dict[str, ast.Module]) -> set[str]:
    """The underscore names the package defines: functions, classes, variables, parameters, its own attributes."""
    own = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.alias) and node.asname:
                own.add(node.asname)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id == "self":
                own.add(node.attr)
    return {name for name in own if private(name)}


def taken_names(tree: ast.Module, own: set[str]) -> set[str]:
    """Underscore names this file takes from elsewhere: attributes read or set, imports, keywords, getattr's strings."""
    taken = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            taken.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and not (node.module or "").startswith(("accel_train", "__future__")):
            taken.update([*(node.module or "").split("."), *(alias.name for alias in node.names)])
        elif isinstance(node, ast.Import):
            taken.update(part for alias in node.names for part in alias.name.split("."))
        elif isinstance(node, ast.keyword) and node.arg:
            taken.add(node.arg)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1 and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            taken.add(node.args[1].value)
    return {name for name in taken if private(name) and name not in own}


def overridden_names(file: str, tree: ast.Module, own: set[str]) -> set[str]:
    """Underscore methods and attributes a class defines that a base class of another library has: its protocol."""
    found = set()
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.bases]
    if not classes:
        return found
    module = importlib.import_module(file.removesuffix(".py").replace("/", "."))
    for node in classes:
        defined = {item.name for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
        defined |= {sub.attr for sub in ast.walk(node) if isinstance(sub, ast.Attribute)
                    and isinstance(sub.ctx, ast.Store) and isinstance(sub.value, ast.Name) and sub.value.id == "self"}
        bases = [base for base in getattr(module, node.name).__mro__[1:]
                 if base is not object and not base.__module__.startswith("accel_train")]
        for name in {name for name in defined if private(name)}:
            if any(name in vars(base) or re.search(rf"\.{name}\b", source_of(base)) for base in bases):
                found.add(name)
    return found


@functools.cache
def source_of(cls: type) -> str:
    """The source of the module that defines `cls` (attributes its methods set are in no class dictionary)."""
    try:
        return Path(inspect.getsourcefile(cls)).read_text()
    except (OSError, TypeError):  # a class of C: its attributes are all it has
        return ""


def used() -> set[tuple[str, str]]:
    trees = parsed()
    own = own_names(trees)
    return {(file, name) for file, tree in trees.items()
            for name in taken_names(tree, own) | overridden_names(file, tree, own)}


def test_every_borrowed_name_is_listed_and_every_listed_one_used():
    found, table = used(), listed()
    assert len(table) >= 5  # the table parsed
    unlisted = sorted(found - table)
    assert not unlisted, ("another library's underscore names, in no row of docs/tests.md's Borrowed internals (use a "
                          "public API, or add a row: why, and the test that fails when it is renamed):\n" +
                          "\n".join(f"{file}: {name}" for file, name in unlisted))
    stale = sorted(table - found)
    assert not stale, ("listed as borrowed but no longer used there (or no longer the library's): delete it from "
                       "docs/tests.md's Borrowed internals:\n" +
                       "\n".join(f"{file}: {name}" for file, name in stale))


def test_every_test_the_borrowed_internals_name_exists():
    named = named_tests(TABLE)
    assert len(named) >= 10
    for file, test in named:
        assert is_defined(file, test), f"{file}::{test}"


def is_torchs_amp_step(torch) -> bool:
    """Each optimizer the package builds takes GradScaler's found_inf on the device."""
    from accel_train.config import TrainConfig
    from accel_train.training.optim import build_optimizer

    model = torch.nn.Linear(2, 1)
    return all(build_optimizer(TrainConfig(optimizer=name), model)._step_supports_amp_scaling is True
               for name in ("sgd", "adam", "adamw"))


def trial_goes_on(optuna) -> bool:
    """A running trial of a study comes back as a Trial that reports and is told (sweep/study.unfinished)."""
    from accel_train.sweep.study import unfinished

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    asked = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    (again,) = unfinished(study)
    again.report(0.5, 1)
    study.tell(again, 0.5)
    return again.number == asked.number and study.trials[0].value == 0.5


KEPT = {
    "_step_supports_amp_scaling": lambda: is_torchs_amp_step(importlib.import_module("torch")),
    "_is_mkldnn_bf16_supported": lambda: isinstance(
        importlib.import_module("torch").ops.mkldnn._is_mkldnn_bf16_supported(), bool),
    "_trial_id": lambda: trial_goes_on(importlib.import_module("optuna")),
    "_info": lambda: "_info" in vars(importlib.import_module("evaluate").EvaluationModule),
    "_compute": lambda: "_compute" in vars(importlib.import_module("evaluate").EvaluationModule),
    "_new_shared": lambda: importlib.import_module("torch").UntypedStorage._new_shared(8).is_shared(),
    "_exit": lambda: callable(os._exit),
    "_current_frames": lambda: threading.main_thread().ident in sys._current_frames(),
}


@pytest.mark.floors
@pytest.mark.parametrize("name", sorted(KEPT))
def test_each_kept_name_is_where_the_installed_library_keeps_it(name):
    assert KEPT[name](), f"{name}: renamed or gone in the installed release; see docs/tests.md's Borrowed internals"


def test_every_kept_name_has_its_check():
    assert {name for _, name in listed()} == set(KEPT)
