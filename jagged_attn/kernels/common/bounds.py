"""Causal bounds of every attention kernel: the one statement of the diagonal in kernel code.

Causal attention is bottom-right aligned (``docs/DESIGN.md``): in a sequence of ``len_q`` queries
and ``len_k`` keys, query ``i`` sees key ``j`` when ``j <= i + diagonal``, ``diagonal = len_k - len_q``.
The kernels ask five questions of it (Triton functions; the Gluon kernels call them too, on scalars
or on index tensors of any layout). The reference backend states the same rule in torch, on its own.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def diagonal(len_q, len_k):
    """The causal diagonal's offset: query ``i`` sees keys ``j <= i + diagonal``."""
    return len_k - len_q


@triton.jit
def sees(queries, keys, diagonal):
    """bool, broadcast of ``queries`` and ``keys`` indices: the query sees the key (causal)."""
    return keys <= queries + diagonal


@triton.jit
def last_key_seen(queries, len_k, diagonal):
    """The last key each query sees (causal; below 0 where it sees none)."""
    return tl.minimum(queries + diagonal, len_k - 1)


@triton.jit
def keys_seen_below(query_end, len_k, diagonal):
    """Keys ``[0, result)`` that the queries before ``query_end`` see (causal): every key some one of
    them sees, and every key that query ``query_end - 1`` sees."""
    return tl.minimum(tl.maximum(query_end + diagonal, 0), len_k)


@triton.jit
def first_query_seeing(key, diagonal):
    """The first query that sees ``key`` (causal); every later query sees it too."""
    return tl.maximum(key - diagonal, 0)


@triton.jit
def first_query_seeing_all(key_end, len_k, query_end, diagonal):
    """The first query from which every later one, up to ``query_end``, sees every key below
    ``key_end`` (causal; a ``diagonal`` of ``len_k`` makes every query see every key): ``query_end``
    when those keys run past the sequence's ``len_k``, since no query sees a key that is not there."""
    return tl.where(key_end > len_k, query_end, tl.minimum(first_query_seeing(key_end - 1, diagonal), query_end))
