"""The machinery of the patch table: what one entry is, when it applies, how it is applied and
restored.

Every change the plugin makes to an object it does not own (megatron-core, megatron.training,
torch.cuda on a machine without CUDA) is one :class:`Patch`: a name, the attributes it replaces
(``"module:qualname"``), the upstream behaviour it corrects, the megatron-core versions it was
written for and the condition under which it applies. Applying is idempotent (an applied patch
is skipped) and every patch can be restored, which puts the original objects back.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Tuple, Union

from megatron_dcp.integration.megatron_import import import_megatron_core

SUPPORTED_VERSIONS: Tuple[Tuple[int, int], ...] = ((0, 19),)
MISSING = object()  # an attribute the target did not have before the patch (restore deletes it)


@dataclass(frozen=True)
class Condition:
    """When a patch applies, with a name for the table listing."""

    name: str
    holds: Callable[[], bool]


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


def _te_installed() -> bool:
    from megatron.core.extensions import transformer_engine

    return bool(transformer_engine.HAVE_TE)


ALWAYS = Condition("always", lambda: True)
NO_CUDA = Condition("no CUDA", _no_cuda)
TE_INSTALLED = Condition("Transformer Engine installed", _te_installed)

# (owner, original) -> replacement; the owner is the object whose attribute is replaced.
Replace = Callable[[Any, Any], Any]


def resolve(target: str) -> Tuple[Any, str]:
    """The owner object and attribute name of a ``"module:qualname"`` target."""
    module, qualname = target.split(":")
    owner = importlib.import_module(module)
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, attr


@dataclass(frozen=True)
class Patch:
    """One entry of the patch table. ``targets`` are ``"module:qualname"`` strings, all replaced
    by ``replace(owner, original)``; ``corrects`` names the upstream behaviour it corrects."""

    name: str
    group: str
    targets: Tuple[str, ...]
    corrects: str
    replace: Replace
    when: Condition = ALWAYS
    versions: Tuple[Tuple[int, int], ...] = SUPPORTED_VERSIONS

    def install(self) -> List[Tuple[Any, str, Any]]:
        """Replace every target; returns (owner, attribute, original) of each."""
        saved = []
        for target in self.targets:
            owner, attr = resolve(target)
            original = getattr(owner, attr, MISSING)
            setattr(owner, attr, self.replace(owner, original))
            saved.append((owner, attr, original))
        return saved

    def uninstall(self, saved: List[Tuple[Any, str, Any]]) -> None:
        for owner, attr, original in reversed(saved):
            if original is MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)


@dataclass(frozen=True)
class ModePatch:
    """An entry that is a global ``TorchFunctionMode`` rather than an attribute: entered when
    applied, exited when restored (on the thread that entered it)."""

    name: str
    group: str
    corrects: str
    make_mode: Callable[[], Any]
    when: Condition = ALWAYS
    versions: Tuple[Tuple[int, int], ...] = SUPPORTED_VERSIONS
    targets: Tuple[str, ...] = ("torch function mode stack",)

    def install(self) -> List[Tuple[Any, str, Any]]:
        mode = self.make_mode()
        mode.__enter__()
        return [(mode, "", MISSING)]

    def uninstall(self, saved: List[Tuple[Any, str, Any]]) -> None:
        saved[0][0].__exit__(None, None, None)


Entry = Union[Patch, ModePatch]


# name -> [(owner, attribute, original)] of every applied patch.
_APPLIED: Dict[str, List[Tuple[Any, str, Any]]] = {}


def is_applied(patch: Entry) -> bool:
    return patch.name in _APPLIED


def apply(patch: Entry) -> bool:
    """Apply ``patch`` when its condition holds; False when it does not or is applied already."""
    if is_applied(patch) or not patch.when.holds():
        return False
    check_version(patch)
    _APPLIED[patch.name] = patch.install()
    return True


def restore(patch: Entry) -> bool:
    """Put back what ``patch`` replaced; False when it was not applied."""
    saved = _APPLIED.pop(patch.name, None)
    if saved is None:
        return False
    patch.uninstall(saved)
    return True


def original_of(patch: Entry, target: str) -> Any:
    """What ``target`` held before the applied ``patch`` replaced it."""
    for (owner, attr, original), name in zip(_APPLIED[patch.name], patch.targets):
        if name == target:
            return original
    raise KeyError(f"{target} is not a target of the applied patch {patch.name}")


def megatron_version() -> Tuple[int, ...]:
    from megatron.core import package_info

    return (package_info.MAJOR, package_info.MINOR, package_info.PATCH)


def check_version(patch: Entry) -> None:
    """The patch was written for the installed megatron-core (it replaces its internals)."""
    if not import_megatron_core():
        raise RuntimeError("megatron-core is not importable; see README.md for the install.")
    version = megatron_version()
    if version[:2] not in patch.versions:
        supported = ", ".join(f"{major}.{minor}.x" for major, minor in patch.versions)
        raise RuntimeError(
            f"megatron_dcp patch {patch.name!r} replaces megatron-core {supported} internals; "
            f"found {'.'.join(map(str, version))}. Install megatron-core {supported}."
        )


@contextmanager
def swapped_attribute(obj: Any, name: str, value: Any) -> Iterator[None]:
    """Set ``obj.name = value`` for the duration of the block, restoring it even on error."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)
