"""Arenas: the memory that holds one rank's finished weights, and the devices it lives on.

`cpu` is a sealed memfd (shared by fd, mapped read-only by engines); `cuda` is a CUDA VMM
allocation exported as a POSIX fd; `devices` says which GPUs there are, by UUID. These
modules allocate, export and map; they know nothing of checkpoints or sockets.

May import: the top-level base modules (`errors`). Nothing else of this package.
"""
