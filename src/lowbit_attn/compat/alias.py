"""The import names ``sageattention`` and ``sageattn3`` (SageAttention3's package) for lowbit_attn's
SageAttention-compatible functions, when the real packages are absent: code that does
``from sageattention import sageattn`` or ``from sageattn3 import sageattn3_blackwell`` then runs
ours, unedited.

Caveats: each alias is a plain module (no ``sageattention.core`` or other submodules); it has no
installed distribution, so checks that read package metadata
(``importlib.metadata.version("sageattention")``, as diffusers' ``is_sageattention_available`` does)
still report SageAttention as absent; and it is process-wide, from the next ``import sageattention``
on (a module that already failed to import it keeps its fallback).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types

NAME = "sageattention"
SAGEATTN3 = "sageattn3"  # SageAttention3's import name: its one function
_lock = threading.Lock()


def _alias_module(alias: str) -> types.ModuleType:
    from lowbit_attn.compat import sageattention as ours

    names = ["sageattn3_blackwell"] if alias == SAGEATTN3 else list(ours.__all__)
    module = types.ModuleType(alias, "lowbit_attn's SageAttention-compatible functions under the "
                                     f"name {alias!r} (lowbit_attn.compat.install_sageattention_alias)")
    for name in names:
        setattr(module, name, getattr(ours, name))
    module.__all__ = names
    module.__lowbit_attn_alias__ = True
    return module


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return _alias_module(spec.name)

    def exec_module(self, module):
        pass


class SageAttentionAliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``sageattention`` and ``sageattn3`` (only those names) as the aliases. It sits last on
    ``sys.meta_path``, so a package installed on ``sys.path``, even later, is found first."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in (NAME, SAGEATTN3):
            return None
        return importlib.util.spec_from_loader(fullname, _Loader(), origin="lowbit_attn.compat")


def _installed_finder():
    return next((f for f in sys.meta_path if isinstance(f, SageAttentionAliasFinder)), None)


def _is_alias(module) -> bool:
    return getattr(module, "__lowbit_attn_alias__", False) is True


def install_sageattention_alias() -> None:
    """Make ``import sageattention`` give :mod:`lowbit_attn.compat.sageattention`'s functions,
    and ``import sageattn3`` its ``sageattn3_blackwell`` (where SageAttention3 is not installed),
    for code you cannot edit (a custom node, a vendored script).

    Idempotent; undone by :func:`uninstall_sageattention_alias`. The alias sits last on
    ``sys.meta_path``, so a package installed later wins; it is one module (no
    ``sageattention.core``) without package metadata, so checks such as diffusers'
    ``is_sageattention_available()`` still say absent.

    Raises:
        RuntimeError: a real ``sageattention`` is importable from ``sys.path`` or already imported
            (it is never shadowed); the message names where it is.

    Examples:
        >>> import sys
        >>> from lowbit_attn import compat
        >>> compat.install_sageattention_alias()
        >>> from sageattention import sageattn                 # this package's shim
        >>> sageattn.__module__
        'lowbit_attn.compat.sageattention'
        >>> compat.uninstall_sageattention_alias()
        True
    """
    with _lock:
        loaded = sys.modules.get(NAME)
        if loaded is not None and not _is_alias(loaded):
            where = getattr(loaded, "__file__", None) or repr(loaded)
            raise RuntimeError(f"a real 'sageattention' is already imported (from {where}); "
                               "lowbit_attn does not shadow it: leave it, or uninstall it to use "
                               "the alias")
        real = importlib.machinery.PathFinder.find_spec(NAME)
        if real is not None:
            where = real.origin or ", ".join(real.submodule_search_locations or ()) or "sys.path"
            raise RuntimeError(f"a real 'sageattention' package is installed at {where}; "
                               "lowbit_attn does not shadow it: import lowbit_attn.compat."
                               "sageattention explicitly, or uninstall it to use the alias")
        if _installed_finder() is None:
            sys.meta_path.append(SageAttentionAliasFinder())


def uninstall_sageattention_alias() -> bool:
    """Remove the aliases: the finder and the ``sageattention`` and ``sageattn3`` modules it made,
    if imported. A real package is never touched.

    Returns:
        Whether anything was removed.

    Examples:
        >>> import sys
        >>> from lowbit_attn import compat
        >>> # none installed: nothing to remove
        >>> compat.uninstall_sageattention_alias()
        False
        >>> "sageattention" in sys.modules
        False
    """
    with _lock:
        removed = False
        finder = _installed_finder()
        while finder is not None:
            sys.meta_path.remove(finder)
            removed = True
            finder = _installed_finder()
        for alias in (NAME, SAGEATTN3):
            if _is_alias(sys.modules.get(alias)):
                del sys.modules[alias]
                removed = True
        return removed
