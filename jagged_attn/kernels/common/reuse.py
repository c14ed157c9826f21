"""Derived tensors kept while their sources live, so that calls on the same inputs skip rebuilding them.

Some launch inputs depend only on tensors a caller passes again and again: the work lists and tile
tables built from a batch's offsets (every layer of a model shares one offsets tensor) and the
Hopper forms of MXFP8 operands quantized once and attended many times (``producers/rebase.py``). :func:`derived`
returns the value built for the same source tensors before, if each source is still the same object
at the same version counter, else builds and keeps it. A forward with a gradient to come also hands
the backward its copies of K and V this way: :func:`keep` by the forward, :func:`take` (which drops
them) by the backward of the same tensors.

What this assumes is what the offsets check already assumes (``offsets.known_valid``): a write that
torch's version counter does not see (through a raw pointer, a numpy array shared with
``torch.from_numpy``) is not seen here either. So nothing is kept for inference tensors (they carry no
version counter), for tensors whose values cannot be read (meta, fake, while torch.compile traces) or
while a CUDA graph is being captured (a kept value would outlive the capture's memory pool).

Memory: a kept value lives as long as the first source tensor (the table holds it weakly), or until
taken; for the Hopper forms of an MXFP8 operand that is about the operand's own size again, for the
backward's copies of K and V about 3 bytes an element of them.
"""

from __future__ import annotations

import weakref
from typing import Callable, Hashable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from jagged_attn.offsets import values_unavailable

# first source -> {params: (stamp of every source, value)}
_kept: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _keepable(sources: tuple[torch.Tensor, ...]) -> bool:
    if any(s.is_inference() or values_unavailable(s) for s in sources):
        return False
    return not (sources[0].is_cuda and torch.cuda.is_current_stream_capturing())


def _stamp(sources: tuple[torch.Tensor, ...]) -> tuple:
    return tuple((weakref.ref(s), s._version) for s in sources)


def _same(stamp: tuple, sources: tuple[torch.Tensor, ...]) -> bool:
    return len(stamp) == len(sources) and all(
        ref() is s and version == s._version for (ref, version), s in zip(stamp, sources))


def keep(sources: tuple[torch.Tensor, ...], params: Hashable, value) -> None:
    """Keep ``value`` for ``params`` while ``sources`` live unwritten (nothing where they cannot be kept).
    ``value`` must depend on nothing but the sources' values and ``params`` and must not hold a reference
    to ``sources[0]`` (that would keep the entry alive forever)."""
    if _keepable(sources):
        _kept.setdefault(sources[0], {})[params] = (_stamp(sources), value)


def _kept_value(sources: tuple[torch.Tensor, ...], params: Hashable, remove: bool):
    if not _keepable(sources) or sources[0] not in _kept:
        return None
    entries = _kept[sources[0]]
    kept = entries.pop(params, None) if remove else entries.get(params)
    return kept[1] if kept is not None and _same(kept[0], sources) else None


def take(sources: tuple[torch.Tensor, ...], params: Hashable):
    """The value kept for ``params`` on these same, unwritten ``sources``, no longer kept; None if none."""
    return _kept_value(sources, params, remove=True)


def derived(sources: tuple[torch.Tensor, ...], params: Hashable, build: Callable):
    """``build()``, or the value it returned for ``params`` on these same, unwritten ``sources`` (kept as
    :func:`keep` keeps a value)."""
    value = _kept_value(sources, params, remove=False)
    if value is None:
        value = build()
        keep(sources, params, value)
    return value
