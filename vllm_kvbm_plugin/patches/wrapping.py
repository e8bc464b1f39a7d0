"""How a patch changes vLLM's classes, and this process's record of it: `wrap_method` and
`add_class_default` (each undone by `remove_all`), `is_wrapped`, and `APPLIED`, the names of the
patches that `vllm_kvbm_plugin.plugin.register` applied. Every patch module imports its tools from here, never
from the package (whose `apply_all` imports the patch modules)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from vllm_kvbm_plugin.log import get_logger

logger = get_logger("patches")

_WRAPPED = "__kvbm_original__"
_UNDO: list[tuple[type, str, object, bool]] = []  # (class, name, previous attribute, was own)
# names of the patches the plugin's register() applied in this process (EngineCore logs them once)
APPLIED: list[str] = []


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
    _UNDO.append((cls, name, raw, name in cls.__dict__))
    setattr(cls, name, classmethod(wrapper) if is_classmethod else wrapper)
    return True


def is_wrapped(cls: type, name: str) -> bool:
    """Whether `cls.name` is one of our wrappers (`wrap_method` applied it in this process)."""
    raw = inspect.getattr_static(cls, name, None)
    return hasattr(getattr(raw, "__func__", raw), _WRAPPED)


def add_class_default(cls: type, name: str, value: object) -> bool:
    """Give `cls` a class attribute `name`, once: the default of per-instance state that our
    wrappers then read as `self.name`. Never read a vLLM object's `__dict__` instead: on CPython
    3.11 that turns the instance's inline attribute values into a dict for good, and every
    attribute access of vLLM's on it gets slower (a BlockPool's: 4.8 -> 16.8 ns, 2.5% of a
    scheduler step)."""
    if name in cls.__dict__:
        return False
    _UNDO.append((cls, name, None, False))
    setattr(cls, name, value)
    return True


def remove_all() -> None:
    """Restore every patched attribute (benchmarks compare against vanilla in one process)."""
    while _UNDO:
        cls, name, raw, was_own = _UNDO.pop()
        if was_own:
            setattr(cls, name, raw)
        else:
            delattr(cls, name)
