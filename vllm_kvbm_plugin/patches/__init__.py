"""Every monkeypatch of vLLM lives here, one module per concern.

Rules: patch methods on class objects (never module attributes, which other modules import by
value); be idempotent (a second apply is a no-op); gate on the vLLM versions we read; each wrapper is
inert unless its feature is configured, so an installed but unconfigured plugin changes nothing;
state kept on vLLM's objects is read through a class default (`add_class_default`), never through
the object's `__dict__`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from vllm_kvbm_plugin import compat
from vllm_kvbm_plugin.log import get_logger

logger = get_logger("patches")

_WRAPPED = "__kvbm_original__"
_APPLIED: list[tuple[type, str, object, bool]] = []  # (class, name, previous attribute, was own)


def wrap_method(cls: type, name: str, make: Callable[[Callable], Callable]) -> bool:
    """Replace `cls.name` by `make(original)`, once. Works for plain and class methods."""
    raw = inspect.getattr_static(cls, name, None)  # may be inherited; we set it on `cls`
    if raw is None:
        raise AttributeError(f"{cls.__qualname__}.{name} not found; vLLM changed, update patches/")
    is_classmethod = isinstance(raw, classmethod)
    func = raw.__func__ if is_classmethod else raw
    if hasattr(func, _WRAPPED):
        return False
    wrapper = functools.wraps(func)(make(func))
    setattr(wrapper, _WRAPPED, func)
    _APPLIED.append((cls, name, raw, name in cls.__dict__))
    setattr(cls, name, classmethod(wrapper) if is_classmethod else wrapper)
    return True


def add_class_default(cls: type, name: str, value) -> bool:
    """Give `cls` a class attribute `name`, once: the default of per-instance state that our
    wrappers then read as `self.name`. Never read a vLLM object's `__dict__` instead: on CPython
    3.11 that turns the instance's inline attribute values into a dict for good, and every
    attribute access of vLLM's on it gets slower (a BlockPool's: 4.8 -> 16.8 ns, 2.5% of a
    scheduler step)."""
    if name in cls.__dict__:
        return False
    _APPLIED.append((cls, name, None, False))
    setattr(cls, name, value)
    return True


def remove_all() -> None:
    """Restore every patched attribute (benchmarks compare against vanilla in one process)."""
    while _APPLIED:
        cls, name, raw, was_own = _APPLIED.pop()
        if was_own:
            setattr(cls, name, raw)
        else:
            delattr(cls, name)


def apply_all() -> list[str]:
    """Apply every patch for the installed vLLM; returns the names applied in this call."""
    if not compat.is_supported():
        logger.warning(
            "vllm-kvbm-plugin supports vLLM %s; found %s: no patches applied",
            "/".join(compat.SUPPORTED),
            compat.vllm_minor(),
        )
        return []
    from vllm_kvbm_plugin.patches import hash_granularity, pic_blend, sub_block_events

    applied = []
    for module in (hash_granularity, sub_block_events, pic_blend):
        if module.apply():
            applied.append(module.NAME)
    return applied
