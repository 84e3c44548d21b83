""":mod:`flexshard.runtime.host_memory`: with freed memory kept, a step's large tensors of varying size are
not faulted in again (page faults counted by the kernel, in a fresh process each, since ``mallopt`` is
for the whole process); with glibc's defaults they are; the switch and its errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.errors import ConfigError
from flexshard.runtime import host_memory

ROOT = Path(__file__).resolve().parents[2]
GLIBC = sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION") is not None

# A fresh process: (maybe) keep freed memory, then tensors of growing size as a step's outputs grow by a
# few rows from step to step, each written once and freed; prints the page faults of each after the first
_FAULTS = """
import json, resource, torch
from flexshard.runtime.host_memory import keep_freed_memory
kept = keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rows = [76000, 76300, 76600, 76900, 77200]  # x 64 floats: 19.5-19.8 MB each
passes = []
for _ in range(4):  # steps repeat: the same range of sizes again
    out = []
    for n in rows:
        f0 = faults()
        x = torch.ones(n, 64)  # written: every page touched
        out.append(faults() - f0)
        del x
    passes.append(out)
print(json.dumps({"kept": kept, "faults": passes[0][1:], "last": passes[-1]}))
"""
PAGES = 76000 * 64 * 4 // 4096  # pages of one such tensor (4 KiB pages)


def _faults(mode: str) -> dict:
    env = {**os.environ, host_memory.ENV: mode, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", _FAULTS], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: Linux with glibc only")
def test_kept_memory_is_not_faulted_in_again():
    got = _faults("keep")
    assert got["kept"] is True
    # the heap grows to its high-water mark in the first passes (a tensor may not fit a hole that a
    # small block freed above it shortens) and is then reused: the last pass faults nothing again
    assert all(f < PAGES // 20 for f in got["last"]), got


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: Linux with glibc only")
def test_glibc_defaults_fault_every_larger_tensor_in_again():
    got = _faults("system")
    assert got["kept"] is False
    # each is above the mmap threshold the last one's free raised: mapped afresh, every page faulted
    assert all(f > PAGES // 2 for f in got["faults"]), got


def test_an_unknown_setting_is_a_config_error_naming_it(monkeypatch):
    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.setenv(host_memory.ENV, "jemalloc")
    with pytest.raises(ConfigError, match="FLEXSHARD_HOST_MALLOC='jemalloc'"):
        host_memory.keep_freed_memory()
