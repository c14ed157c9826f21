"""Persistent launches of the Gluon kernels: one program per SM (:func:`resident_programs`; the
backward's short-tile launches take their items in fixed turns), each taking work items until none
is left.

In ``sm90.forward`` a program's first item is its program index; each next one comes from a
launch-wide counter (:func:`counter`, zeroed per launch), taken by the one partition that hands
items out (the loader warp) once it has issued the current item's loads, and handed to the other
partitions through a two-slot ring in shared memory (:class:`ItemRing`); an index past the last
item tells them to stop. So the work list's dearest
items go first, each to the program that is free first: a fixed share per program (``p, p +
programs, ...``) left some programs the dearest item of every round, since causal batches' costs
fall along each sequence. A program sets up its shared memory and barriers once, and its rings run
on from item to item, so an item's first loads overlap the previous item's last steps and stores.
"""

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import constexpr_function
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.language.core import _aggregate as aggregate  # Triton 3.6's Gluon does not export it yet


@aggregate
class ItemRing:
    """The items one partition hands the others, double-buffered: ``slot`` int32 ``[2, 2]`` (slot b:
    the item and the ring position it starts at, i.e. the earlier items' pipeline steps), ``ready[b]``
    once slot b was written, ``free[b]`` once every taking partition is done with its item;
    ``next_item`` the launch's int32 ``[1]`` counter of items taken after the first round."""
    slot: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    free: gl.shared_memory_descriptor
    next_item: gl.tensor

    @constexpr_function
    def __init__(self, slot, ready, free, next_item):
        self.slot, self.ready, self.free, self.next_item = slot, ready, free, next_item


@gluon.jit
def item_ring(next_item, TAKERS: gl.constexpr):
    """An :class:`ItemRing` on the launch's counter ``next_item``, read by TAKERS partitions; made
    before the partitions start (its barriers initialized, not yet fenced)."""
    slot = gl.allocate_shared_memory(gl.int32, [2, 2], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(2):
        mbarrier.init(ready.index(b), count=1)
        mbarrier.init(free.index(b), count=TAKERS)
    return ItemRing(slot, ready, free, next_item)


@constexpr_function
def _every_thread(warps):
    """A ``[2]`` layout whose two values every thread of ``warps`` warps holds."""
    return gl.BlockedLayout([2], [32], [warps], [0])


@gluon.jit
def hand_out(ring, k, item, first, WARPS: gl.constexpr):
    """The handing partition (WARPS warps): ``item``, starting at ring position ``first``, as its
    program's k-th, into slot k % 2 once the takers are done with that slot's previous item."""
    b = k % 2
    mbarrier.wait(ring.free.index(b), ((k // 2) & 1) ^ 1)
    pair = gl.arange(0, 2, layout=_every_thread(WARPS))
    ring.slot.index(b).store(gl.where(pair == 0, item, first))
    gl.thread_barrier()  # every warp's store done before the arrive
    mbarrier.arrive(ring.ready.index(b), count=1)


@gluon.jit
def take(ring, k, WARPS: gl.constexpr):
    """A taking partition (WARPS warps): (item, first ring position) of its program's k-th item, once
    handed out; its slot stays held until :func:`release`."""
    mbarrier.wait(ring.ready.index(k % 2), (k // 2) & 1)
    pair = ring.slot.index(k % 2).load(_every_thread(WARPS))
    positions = gl.arange(0, 2, layout=_every_thread(WARPS))
    return gl.max(gl.where(positions == 0, pair, -1), axis=0), gl.max(gl.where(positions == 1, pair, -1), axis=0)


@gluon.jit
def release(ring, k):
    """A taking partition, done with its program's k-th item: every warp has read its slot."""
    gl.thread_barrier()
    mbarrier.arrive(ring.free.index(k % 2), count=1)


@gluon.jit
def next_item(ring):
    """The handing partition: the launch's next item (the first round, ``0 .. programs - 1``, went
    to the programs by their index)."""
    return gl.num_programs(0) + gl.atomic_add(ring.next_item, 1)


def counter(device) -> torch.Tensor:
    """A launch's zeroed item counter (int32 ``[1]``)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def program_count(items: int, device: torch.device) -> int:
    """Programs of a persistent launch of ``items`` work items: one per SM, at most one per item."""
    return min(items, resident_programs(device))


@functools.cache
def resident_programs(device: torch.device) -> int:
    """SMs of ``device``: how many programs of a kernel that fills an SM's shared memory run at once."""
    return torch.cuda.get_device_properties(device).multi_processor_count
