"""User code by import path (`model.name: my_models:Net`): found, checked and called with one-line errors.

A module is looked for on sys.path, in the folder of the recipe that names it and in the current directory,
in every process: launchers run the same command line, so each worker loads the same recipe and searches
the same folders.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from accel_train.errors import DataNotFoundError, UserError

SOURCES = ("hf", "timm")  # name prefixes of the places models and data come from by name: not modules


def source_of(name: str) -> str | None:
    """"hf" for hf:REPO, "timm" for timm:NAME; None for any other name (a registry name, an import path)."""
    prefix, sep, _ = name.partition(":")
    return prefix if sep and prefix in SOURCES else None


def is_import_path(name: str) -> bool:
    return ":" in name and source_of(name) is None


def given_object_name(obj: Any) -> str:
    """What the config records for an object passed to accel_train.train in place of a name."""
    return f"<{type(obj).__module__}.{type(obj).__qualname__}>"


def is_given_object(name: str) -> bool:
    return name.startswith("<") and name.endswith(">")


def add_search_dir(folder: str | Path) -> None:
    """Modules in `folder` become importable by import paths (a recipe file's folder)."""
    folder = str(Path(folder).resolve())
    if folder not in sys.path:
        sys.path.append(folder)


def import_object(path: str, key: str) -> Any:
    """The object `module:attribute` names, or one UserError naming the key, what was found and what was expected."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute or ":" in attribute:
        raise UserError(f"{key}={path}: an import path is module:attribute, e.g. my_models:Net")
    add_search_dir(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise UserError(f"{key}={path}: no module {module_name} on sys.path, in the recipe's folder or in "
                            f"{os.getcwd()}") from None
        raise UserError(f"{key}={path}: importing {module_name} failed: {err}") from None
    except Exception as err:  # the user's module raised while it was imported: say where
        where = f" ({err.filename}, line {err.lineno})" if isinstance(err, SyntaxError) else ""
        raise UserError(f"{key}={path}: importing {module_name} failed: {type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else ''}{where}") from None
    found = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            names = sorted(name for name in vars(module) if not name.startswith("_"))
            raise UserError(f"{key}={path}: {module_name} ({getattr(module, '__file__', '?')}) has no {attribute}; "
                            f"it has {', '.join(names) or 'nothing public'}")
        found = getattr(found, part)
    return found


@contextmanager
def building(named: str, data: bool = False, doing: str = "building it"):
    """What a user's function (or a library's, by import path) raises while it builds what `named` ("data.name=...")
    names: one line naming it, the exception and the line of code that raised it. Exit 3 for data (it could not be
    read) and for a model's file or network error (its weights not found); else 2, as for a setting to change."""
    try:
        yield
    except UserError:
        raise
    except Exception as err:
        frame = traceback.extract_tb(err.__traceback__)[-1]
        line = f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
        kind = DataNotFoundError if data or isinstance(err, OSError) else UserError
        raise kind(f"{named}: {doing} raised {line} (at {Path(frame.filename).name}:{frame.lineno})") from None


def check_call(function: Callable, key: str, path: str, args_key: str, given: dict[str, Any], args: dict[str, Any],
               optional: frozenset[str] = frozenset(), through_any: frozenset[str] = frozenset()) -> dict:
    """The keyword arguments to call `function` with: what accel-train `given` (less the `optional` names the
    signature does not name, except `through_any` ones, set, where it takes **kwargs) and the user's `args`
    (`args_key`, e.g. model.args).

    One UserError when a required parameter is left without a value or a name passed is not one it takes.
    """
    if not callable(function):
        raise UserError(f"{key}={path}: found {type(function).__name__} {function!r}, expected a class or function")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a signature: call it with what was given
        return {**given, **args}
    parameters = signature.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    keywords = {name for name, p in parameters.items()
                if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    # a factory with **kwargs (timm's create_model, most zoos) passes them on to a model that may not take them
    call = {name: value for name, value in given.items() if name in keywords or name not in optional
            or takes_any and name in through_any and value is not None}
    call.update(args)
    shown = f"{getattr(function, '__name__', path)}{signature.replace(return_annotation=inspect.Signature.empty)}"
    for name in call:
        if takes_any or name in keywords:
            continue
        if name in args:
            raise UserError(f"{key}={path}: {shown} takes no {name}; remove {args_key}.{name}, or add {name} to its "
                            "parameters")
        raise UserError(f"{key}={path}: {shown} takes no {name}, which accel-train passes; add a {name} parameter")
    missing = [name for name, p in parameters.items() if p.default is inspect.Parameter.empty
               and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
               and name not in call]
    if missing:
        raise UserError(f"{key}={path}: {shown} needs {', '.join(missing)}, which nothing gives; set "
                        f"{', '.join(f'{args_key}.{name}' for name in missing)}")
    return call
