"""SGLang's `--load-format weightcache`, registered through SGLang's plugin entry point.

SGLang runs the functions named under the entry-point group `sglang.srt.plugins` in every
process it starts (the launcher before it parses its arguments, each scheduler process, one per
tensor-parallel rank, before it builds its model) because `pyproject.toml` names `register`
there: installing weightcache next to SGLang is the whole integration. `register`:
  1. adds `weightcache` to the choices of `--load-format` (SGLang's `add_load_format_choices`),
     so that the launcher's argument parser takes it;
  2. registers one hook with SGLang's own hook registry (`HookRegistry`, which SGLang applies
     once every plugin has run): when a `LoadConfig` is made with the load format
     `weightcache`, its load format becomes the loader class, `sglang_loader.WeightcacheModelLoader`,
     which SGLang's `get_model_loader` instantiates as it does any loader class it is given.
The loader (and SGLang's loader modules with it) is imported only when a scheduler builds a
`LoadConfig` asking for it, so this module costs nothing anywhere else. SGLang's offline engine
takes the class itself as well: `sglang.Engine(..., load_format=WeightcacheModelLoader)`.
"""
from __future__ import annotations

from typing import Any, Callable

LOAD_FORMAT = "weightcache"
# the hook's target: where SGLang turns a `--load-format` string into its `LoadFormat`
VERIFY_TARGET = "sglang.srt.configs.load_config.LoadConfig._verify_load_format"
_registered = False


def register() -> None:
    """Make `--load-format weightcache` known to SGLang in this process (idempotent)."""
    global _registered
    from sglang.srt.server_args import LOAD_FORMAT_CHOICES, add_load_format_choices

    if LOAD_FORMAT not in LOAD_FORMAT_CHOICES:
        add_load_format_choices([LOAD_FORMAT])
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(VERIFY_TARGET, resolve_load_format, HookType.AROUND)
    _registered = True


def resolve_load_format(original: Callable[[Any], None], load_config: Any) -> None:
    """Around `LoadConfig._verify_load_format`: `weightcache` becomes the loader class; any other
    format goes through SGLang's own check."""
    fmt = load_config.load_format
    if isinstance(fmt, str) and fmt.lower() == LOAD_FORMAT:
        from .sglang_loader import WeightcacheModelLoader

        load_config.load_format = WeightcacheModelLoader
        return None
    return original(load_config)
