"""The vLLM plugin that asks Linux for the AMX state vLLM's CPU attention kernel uses.

End to end, tests/test_extract.py's parity and resume runs (a bf16 Llama with 64-wide heads,
whose first request is a 2-token prompt) died with SIGILL on an AMX host without it; here,
the mechanism in seconds, in a fresh process."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

pytestmark = pytest.mark.vllm

# A fresh interpreter with vLLM's platform and torch loaded, as in a vLLM worker before its
# first kernel: does it hold the AMX tile state before and after the plugin's hook?
PROBE = """
import ctypes
import torch
from vllm.platforms import current_platform

SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1022, 18
libc = ctypes.CDLL(None, use_errno=True)

def granted():
    mask = ctypes.c_ulong(0)
    assert libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) == 0
    return bool(mask.value >> XFEATURE_XTILEDATA & 1)

assert current_platform.is_cpu()
before = granted()
from draftsmith import vllm_cpu_amx
vllm_cpu_amx.register()
print(before, granted())
"""


def test_vllm_finds_the_plugin_through_the_installed_entry_point():
    plugins = {entry.name: entry.value for entry in entry_points(group="vllm.general_plugins")}
    assert plugins.get("draftsmith_cpu_amx") == "draftsmith.vllm_cpu_amx:register"


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="this CPU has no AMX")
def test_a_vllm_process_holds_the_amx_state_once_the_plugin_registered():
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    before, after = result.stdout.split()[-2:]
    assert (before, after) == ("False", "True")
