"""context_parallel_attention on 2 and 3 gloo processes: each rank's output, LSE and q/k/v gradients equal the
rows it holds of one call over the whole batch (exact attention in fp64 through the partial-attention core; the
public call with the MXFP8 reference backend to MXFP8 rounding)."""

import functools
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings, strategies as st

import jagged_attn as ja
from attention_oracle import padded_attention
from jagged_attn.context_parallel import _context_parallel
from jagged_attn.metrics import relative_l2
from jagged_attn.offsets import offsets_from_lengths

RAGGED = [0, 1, 31, 32, 33, 127, 128, 129]
# (lengths_q, lengths_k or None for self-attention, heads_q, heads_kv)
EXACT_CASES = [
    (RAGGED + [2, 3, 200], None, 2, 2),
    ([129, 33, 1, 0, 64, 31], None, 4, 2),
    ([1, 31, 33, 0, 129, 2, 5], [32, 31, 129, 5, 128, 1, 0], 2, 1),  # cross: L_k above, equal and below L_q
]


def batch(lengths_q, lengths_k, heads_q, heads_kv, dtype):
    lengths_k = lengths_q if lengths_k is None else lengths_k
    oq, ok = offsets_from_lengths(torch.tensor(lengths_q)), offsets_from_lengths(torch.tensor(lengths_k))
    q = torch.randn(sum(lengths_q), heads_q, 32, dtype=dtype)
    k, v = (torch.randn(sum(lengths_k), heads_kv, 32, dtype=dtype) for _ in range(2))
    return q, k, v, oq, ok


def weighted_loss(out, lse, dout, dlse):
    """O and the LSE weighted by random tensors (the LSE where finite)."""
    return (out * dout).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse).sum()


def whole_rows(whole_call, q, k, v, oq, ok, causal, dout, dlse):
    """(out, lse, dq, dk, dv) of ``whole_call`` on the whole batch, the rows this rank holds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out, lse = whole_call(*leaves, oq, ok, causal)
    results = [out, lse, *torch.autograd.grad(weighted_loss(out, lse, dout, dlse), leaves)]
    return [ja.context_parallel_shard(x.detach(), o, rank, world) for x, o in zip(results, (oq, oq, oq, ok, ok))]


def sharded_and_whole(call, whole_call, q, k, v, oq, ok, causal):
    """On this rank: (out, lse, dq, dk, dv) of ``call`` on its shards and the same rows of ``whole_call`` on
    the whole batch, for one loss of O and the LSE (the same random weights on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dout, dlse = torch.randn_like(q), torch.randn(q.shape[:2], dtype=q.dtype)
    whole = whole_rows(whole_call, q, k, v, oq, ok, causal, dout, dlse)
    shards = [ja.context_parallel_shard(x, o, rank, world).requires_grad_(True)
              for x, o in zip((q, k, v), (oq, ok, ok))]
    out, lse = call(*shards, oq, ok, causal)
    weighted_loss(out, lse, *(ja.context_parallel_shard(x, oq, rank, world) for x in (dout, dlse))).backward()
    return [out.detach(), lse.detach(), *(x.grad for x in shards)], whole, (dout, dlse)


def exact_worker(seed, cases=EXACT_CASES, causal_modes=(False, True)):
    torch.manual_seed(seed)  # the same batch on every rank
    for lengths_q, lengths_k, heads_q, heads_kv in cases:
        inputs = batch(lengths_q, lengths_k, heads_q, heads_kv, torch.float64)
        for causal in causal_modes:
            def call(q, k, v, oq, ok, causal):
                return _context_parallel(padded_attention, q, k, v, oq, ok, causal, None)
            got, want, _ = sharded_and_whole(call, padded_attention, *inputs, causal)
            assert torch.equal(torch.isinf(got[1]), torch.isinf(want[1]))
            for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
                torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name} causal={causal}: {m}")


def rows_check_worker(seed):
    q = torch.randn(10, 2, 32)
    with pytest.raises(ValueError, match="q has 10 rows but rank"):
        ja.context_parallel_attention(q, q, q, torch.tensor([0, 10]), backend="reference")
    with pytest.raises(ValueError, match="non-decreasing"):
        ja.context_parallel_attention(q, q, q, torch.tensor([0, 12, 10]), backend="reference")


def mxfp8_worker(seed):
    """The public call with the reference backend (fp32), centered (each key part on its own means) or not:
    the LSE, uncentered, to fp32 rounding; O and the gradients as far from fp64 attention as the whole call
    (each part rounds P against its own row maximum, V in blocks from the shard's first token, dO times its
    merge weight: the same rules on other grids)."""
    torch.manual_seed(seed)
    world = dist.get_world_size()

    def call(q, k, v, oq, ok, causal, center_kv=False):
        return ja.context_parallel_attention(q, k, v, oq, ok, causal=causal, backend="reference", return_lse=True,
                                             center_kv=center_kv)

    def whole_call(q, k, v, oq, ok, causal, center_kv=False):
        return ja.jagged_attention(q, k, v, oq, ok, causal=causal, backend="reference", return_lse=True,
                                   center_kv=center_kv)

    aligned = [32 * world * n for n in (0, 1, 3)]
    cases = [(aligned, True, False), (aligned, False, False), ([129, 1, 0, 33, 100], True, False),
             ([129, 1, 0, 33, 100], True, True)]
    for lengths, causal, center_kv in cases:
        inputs = batch(lengths, None, 4, 2, torch.float32)
        got, want, weights = sharded_and_whole(functools.partial(call, center_kv=center_kv),
                                               functools.partial(whole_call, center_kv=center_kv), *inputs, causal)
        fp64 = [x.double() for x in inputs[:3]] + list(inputs[3:])
        truth = whole_rows(padded_attention, *fp64, causal, *(x.double() for x in weights))
        seen = torch.isfinite(want[1])
        assert torch.equal(torch.isfinite(got[1]), seen)
        if not center_kv:
            assert relative_l2(got[1][seen], want[1][seen]) < 1e-5
        for name, g, w, t in zip(("out", "lse", "dq", "dk", "dv"), got, want, truth):
            if name != "lse" and t.numel():
                assert torch.isfinite(g).all(), name
                assert relative_l2(g, t) <= 1.25 * relative_l2(w, t) + 1e-6, (name, lengths, causal)


def _run(rank, world, init_file, worker, seed, *worker_args):
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        worker(seed, *worker_args)
    finally:
        dist.destroy_process_group()


def spawn(worker, world, *worker_args):
    with tempfile.TemporaryDirectory() as tmp:
        seed = int(torch.randint(0, 2**31, ()))
        # fork: the ranks start with jagged_attn imported (spawn re-imports it, ~10 s per test on 2 cores)
        mp.start_processes(_run, args=(world, os.path.join(tmp, "init"), worker, seed, *worker_args),
                           nprocs=world, start_method="fork")


@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_is_one_call_fp64(world):
    """Exact attention through the partial-attention core: ragged lengths 0-200, causal and not, GQA, causal
    cross-attention with L_k above and below L_q (bottom-right alignment across shards)."""
    spawn(exact_worker, world)


LENGTHS = st.sampled_from(RAGGED + [2, 3, 64, 65, 97, 300])


@settings(max_examples=8, deadline=None)
@given(lengths=st.lists(st.tuples(LENGTHS, LENGTHS), min_size=1, max_size=4), self_attention=st.booleans(),
       causal=st.booleans(), group=st.sampled_from([1, 2]), world=st.sampled_from([2, 3]))
def test_context_parallel_is_one_call_fp64_property(lengths, self_attention, causal, group, world):
    """As above over drawn ragged batches (query and key lengths drawn apart for cross-attention)."""
    lengths_q = [pair[0] for pair in lengths]
    lengths_k = None if self_attention else [pair[1] for pair in lengths]
    spawn(exact_worker, world, [(lengths_q, lengths_k, 2, 2 // group)], (causal,))


def test_context_parallel_mxfp8_reference():
    spawn(mxfp8_worker, 2)


def test_rows_must_be_this_ranks_shard():
    spawn(rows_check_worker, 2)


def test_shard_rule_and_row_count_check():
    offsets = torch.tensor([0, 5, 5, 6, 40])
    x = torch.arange(40)
    shards = [ja.context_parallel_shard(x, offsets, r, 3) for r in range(3)]
    assert shards[0].tolist() == [0, *range(6, 17)]  # lengths 5, 0, 1, 34: [0, L // 3) of each
    assert shards[1].tolist() == [1, 2, *range(17, 28)]
    assert torch.equal(torch.cat(shards).sort().values, x)
    assert shards[2].tolist() == [3, 4, 5, *range(28, 40)]
