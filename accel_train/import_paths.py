"""User code by import path (`model.name: my_models:Net`): located, trusted, loaded from its own file, and called with
one-line errors.

An import path is code. One the user gave (their recipe file, an override, a Config built in Python) is theirs; one
read from a file someone else may have written (a run folder's config.yaml) runs only on the command's word
(config/trust.py decides, and `distrust` marks what it has not allowed). A module is looked for on sys.path (as
Python would import it), then in the folders of the recipe files that name it (a run's config.yaml: the folders its
modules were loaded from when it trained), then in the current directory; one found in such a folder is loaded from
its own file, by a finder that serves exactly the modules import paths named: no folder is put on sys.path, so a file
there that nobody named (an `opt_einsum.py` torch looks for) is never imported. Every process runs the same command
line, so each locates the same files.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accel_train.errors import DataNotFoundError, UserError

SOURCES = ("hf", "timm")  # name prefixes of the places models and data come from by name: not modules
IMPORT_PATH_KEYS = ("model.name", "data.name", "task", "data.image_transform")  # the keys that may name code


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


def top_module(path: str) -> str:
    """`pkg.models:Net` -> `pkg`: the module Python looks for first, the one a folder may hold."""
    return path.partition(":")[0].split(".")[0]


@dataclass(frozen=True)
class Located:
    """Where an import path's top-level module is: its file (a package's __init__.py), and the folder of the
    search that holds it (None: Python finds it on sys.path itself, or it is built in)."""

    module: str
    found: bool
    file: Path | None  # None: built in (sys), a namespace package, or not found
    folder: Path | None

    @property
    def holder(self) -> Path | None:
        """The folder that holds the module (a package's parent), where it is found again by name."""
        if self.file is None:
            return None
        return self.file.parent.parent if self.file.name == "__init__.py" else self.file.parent

    def code_files(self) -> list[Path]:
        """The files whose content is this module's code: the module's file, or every .py file of its package."""
        if self.file is None:
            return []
        if self.file.name != "__init__.py":
            return [self.file]
        return sorted(path for path in self.file.parent.rglob("*.py") if "__pycache__" not in path.parts)

    def content_hash(self) -> str:
        """sha256 over the module's code files, their names and bytes (a package: every file of it)."""
        digest = hashlib.sha256()
        for path in self.code_files():
            digest.update(str(path.relative_to(self.file.parent)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
        return digest.hexdigest() if self.file is not None else "built-in"


def locate(path: str, folders: Iterable[Path]) -> Located:
    """The file of the module `path` starts with, without running any of it: on sys.path as Python would import it,
    else in the first of `folders` that holds `module.py` or `module/__init__.py`."""
    module = top_module(path)
    served = _NAMED.files.get(module)
    if served is not None:  # allowed before, from a folder: the same file again
        return Located(module, True, served[0], served[1])
    try:
        spec = importlib.util.find_spec(module)  # a top-level name: its finders look, nothing is executed
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        origin = spec.origin if spec.has_location else getattr(spec.loader_state, "filename", None)  # frozen: os
        return Located(module, True, Path(origin).resolve() if origin else None, None)
    for folder in folders:
        for candidate in (folder / f"{module}.py", folder / module / "__init__.py"):
            if candidate.is_file():
                return Located(module, True, candidate.resolve(), folder.resolve())
    return Located(module, False, None, None)


class _NamedModules(importlib.abc.MetaPathFinder):
    """Serves the top-level modules import paths named and a search folder holds, each from its own file, after
    Python's own finders (sys.path first, as appending the folder to sys.path used to). A package's submodules are
    found by Python through the package's own __path__."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[Path, Path]] = {}  # module -> (its file, the folder it was found in)

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname not in self.files:
            return None
        file = self.files[fullname][0]
        package = [str(file.parent)] if file.name == "__init__.py" else None
        return importlib.util.spec_from_file_location(fullname, file, submodule_search_locations=package)


_NAMED = _NamedModules()
sys.meta_path.append(_NAMED)
_DISTRUSTED: dict[str, str] = {}  # import path -> the line refusing it: named by a file this command did not trust
_ALLOWED: set[str] = set()  # import paths this process may import (and may have): named again by any file, the same


def allow(path: str, located: Located) -> None:
    """`path` may be imported; a module found in a search folder is served from its file from now on."""
    _DISTRUSTED.pop(path, None)
    _ALLOWED.add(path)
    if located.folder is None or located.file is None:
        return
    held = _NAMED.files.get(located.module)
    if held is not None and held[0] != located.file and located.module in sys.modules:
        raise UserError(f"{path}: module {located.module} is {held[0]} in this process already, and {located.file} "
                        "here; give the modules different names")
    _NAMED.files[located.module] = (located.file, located.folder)


def distrust(path: str, line: str) -> None:
    """`path` was named by a file this command does not trust: importing it raises `line` unless it is allowed, before
    (this process may already run that code) or since."""
    if path not in _ALLOWED:
        _DISTRUSTED[path] = line


def is_distrusted(path: str) -> bool:
    return path in _DISTRUSTED


def import_object(path: str, key: str) -> Any:
    """The object `module:attribute` names, or one UserError naming the key, what was found and what was expected."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute or ":" in attribute:
        raise UserError(f"{key}={path}: an import path is module:attribute, e.g. my_models:Net")
    if path in _DISTRUSTED:
        raise UserError(_DISTRUSTED[path])
    if top_module(path) not in _NAMED.files:  # a Config made in Python: its modules are looked for here too
        located = locate(path, [Path.cwd()])
        if located.found:
            allow(path, located)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise UserError(f"{key}={path}: no module {module_name} on sys.path, in the recipe's folder or in "
                            f"{os.getcwd()}") from None
        raise UserError(f"{key}={path}: importing {module_name} failed: {err}{_beside(module_name, err.name)}") \
            from None
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


def _beside(module_name: str, missing: str | None) -> str:
    """Why a module beside the named one is not found: only named modules are loaded from a folder."""
    served = _NAMED.files.get(module_name.split(".")[0])
    if served is None or not missing:
        return ""
    folder = served[1]
    top = missing.split(".")[0]
    if not ((folder / f"{top}.py").is_file() or (folder / top / "__init__.py").is_file()):
        return ""
    return (f"; {top} is beside it in {folder}, but a folder's modules are loaded only where an import path names "
            "them (a file there named like a module a library looks for would run otherwise): make the folder a "
            f"package and import it relatively, or put {folder} on PYTHONPATH")


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
