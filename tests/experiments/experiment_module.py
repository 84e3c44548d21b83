"""Load a script of experiments/ as a module, for tests of its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def load_experiment(name: str) -> ModuleType:
    """``experiments/<name>.py`` as a module (its ``main`` is not run), registered in ``sys.modules``
    as ``<name>_experiment`` so that its dataclasses and pickles resolve. experiments/ goes on
    ``sys.path`` first, as when a script runs, so that the scripts' ``import study`` works."""
    if str(EXPERIMENTS) not in sys.path:
        sys.path.insert(0, str(EXPERIMENTS))
    key = f"{name}_experiment"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, EXPERIMENTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]
