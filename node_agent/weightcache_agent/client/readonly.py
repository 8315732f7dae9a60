"""Attached weights are read-only: a write to one must say so, not just crash.

The cpu backend maps the agent's arena PROT_READ, because the same pages back every
engine on the node; an in-place write (a weight post-processed after loading) is a
SIGSEGV. `guard` makes that fault explain itself: it turns on `faulthandler` (the Python
traceback of the write) when nothing else has, and registers the mapping with the
optional `_rofault` C handler, which prints one line naming the cause and the fixes
before the fault takes its course. Without the C extension the traceback still comes.

The fix for callers that must write is `attach(..., copy_on_write=True)` (see
`arena.cpu.map_private`): untouched pages stay shared, each page written costs a private
copy.
"""
from __future__ import annotations

import faulthandler
import sys

import torch

try:
    from . import _rofault
except ImportError:  # built without a C compiler: faulthandler's traceback alone
    _rofault = None


def guard(base: torch.Tensor) -> None:
    """Make a write into `base` (a read-only mapping) fail with a message naming the cause."""
    if not faulthandler.is_enabled():
        try:
            faulthandler.enable(file=sys.__stderr__ or sys.stderr, all_threads=True)
        except (AttributeError, ValueError, OSError, RuntimeError):
            pass  # no usable stderr (an embedding host): nothing to print to anyway
    if _rofault is not None and base.numel() > 0:
        _rofault.install()  # after faulthandler: ours runs first, then hands the fault on to it
        _rofault.watch(base.data_ptr(), base.numel() * base.element_size())
