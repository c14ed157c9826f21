"""Drop-in use (issue #28): torch.autocast, containers by protocol (torchrec's JaggedTensor API, fbgemm's
2-D values), and ``backend="auto"`` on a GPU without a kernel path."""

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import jagged_attn as ja
from jagged_attn import backends
from jagged_attn.jagged import pack_attention_nested
from jagged_attn.offsets import offsets_from_lengths

EDGE_LENGTHS = [0, 1, 31, 32, 33, 127, 128, 129, 200]


def _inputs(lengths_q=(3, 0, 40, 33), lengths_k=(50, 2, 0, 33), hq=4, hkv=2, dim=64):
    oq, ok = offsets_from_lengths(torch.tensor(lengths_q)), offsets_from_lengths(torch.tensor(lengths_k))
    q = torch.randn(int(oq[-1]), hq, dim)
    k = torch.randn(int(ok[-1]), hkv, dim)
    v = torch.randn(int(ok[-1]), hkv, dim)
    return q, k, v, oq, ok


class TorchrecStyleJT:
    """The shape of torchrec's ``JaggedTensor`` API that the protocol relies on: ``.values()`` and
    ``.offsets()`` methods and a keyword constructor (torchrec is not a dependency)."""

    def __init__(self, values, weights=None, lengths=None, offsets=None):
        self._values, self._offsets = values, offsets

    def values(self):
        return self._values

    def offsets(self):
        return self._offsets


class TorchrecStyleKJT(TorchrecStyleJT):
    """torchrec's ``KeyedJaggedTensor``: several keys' values under one offsets tensor."""

    def keys(self):
        return ["q"]


# --- torch.autocast ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_runs_mixed_dtypes_in_its_dtype_and_grads_keep_theirs(dtype):
    """RoPE under autocast leaves q, k float32 and v in the autocast dtype: the call runs all three in
    the autocast dtype (read at the call, so fp16 as well as bf16), exactly as the same call outside
    autocast on inputs cast by hand (the op disables autocast inside: the reference's own math keeps
    its precision); the gradients reach each input in its own dtype."""
    q, k, v, oq, ok = _inputs()
    v = v.to(dtype)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    with torch.autocast("cpu", dtype=dtype):
        out, lse = ja.jagged_attention(*leaves, oq, ok, causal=True, return_lse=True)
    cast = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
    expected, expected_lse = ja.jagged_attention(*cast, oq, ok, causal=True, return_lse=True)
    assert out.dtype == dtype and torch.equal(out, expected) and torch.equal(lse, expected_lse)
    dout = torch.randn_like(out)
    out.backward(dout)
    expected.backward(dout)
    for leaf, reference in zip(leaves, cast):
        assert leaf.grad.dtype == leaf.dtype
        assert torch.equal(leaf.grad, reference.grad.to(leaf.dtype))


def test_autocast_stays_outside_the_ops():
    """Inputs already in the autocast dtype, and MXFP8 inputs, give the same output and gradients as
    without autocast, the backward called inside the autocast region too (autocast used to move the
    reference's float32 math to bf16: differences of 0.1-0.2)."""
    q, k, v, oq, ok = _inputs()
    inputs = [x.bfloat16() for x in (q, k, v)]
    mx = (ja.quantize_mxfp8(q, oq), ja.quantize_mxfp8(k, ok), ja.quantize_mxfp8(v, ok, axis="sequence"))
    results = []
    for autocast in (False, True):
        leaves = [x.clone().requires_grad_(True) for x in inputs]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = ja.jagged_attention(*leaves, oq, ok, causal=True)
            out.float().square().sum().backward()
            out_mx = ja.jagged_attention(*mx, causal=True)
        results.append([out, *(leaf.grad for leaf in leaves), out_mx])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_mixed_dtypes_outside_autocast_still_raise():
    q, k, v, oq, ok = _inputs()
    with pytest.raises(TypeError, match="must share a dtype"):
        ja.jagged_attention(q, k, v.bfloat16(), oq, ok)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False), pytest.raises(TypeError, match="share a dtype"):
        ja.jagged_attention(q, k, v.bfloat16(), oq, ok)
    with pytest.raises(TypeError, match="share a dtype"):  # a device type without autocast
        ja.jagged_attention(q.to("meta"), k.to("meta"), v.to("meta", torch.bfloat16), oq.to("meta"), ok.to("meta"))


def test_autocast_under_torch_compile_matches_eager():
    q, k, v, oq, ok = _inputs()
    v = v.bfloat16()

    def attend(a, b, c):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return ja.jagged_attention(a, b, c, oq, ok, causal=True)

    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = torch.compile(attend, fullgraph=True, backend="aot_eager")(*leaves)
    out.float().sum().backward()
    eager_leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    expected = attend(*eager_leaves)
    expected.float().sum().backward()
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    for leaf, eager in zip(leaves, eager_leaves):
        assert leaf.grad.dtype == leaf.dtype and torch.equal(leaf.grad, eager.grad)


# --- containers -------------------------------------------------------------------------------------------------


def test_torchrec_style_jagged_tensors_in_and_out():
    """Objects with ``.values()`` / ``.offsets()`` give their offsets (no 'offsets_q is required'), the
    output comes back as the same type, and gradients reach their values."""
    q, k, v, oq, ok = _inputs()
    expected = ja.jagged_attention(q, k, v, oq, ok, causal=True)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = ja.jagged_attention(*(TorchrecStyleJT(x, offsets=o) for x, o in zip(leaves, (oq, ok, ok))), causal=True)
    assert type(out) is TorchrecStyleJT and out.offsets() is oq and torch.equal(out.values(), expected)
    out.values().sum().backward()
    assert all(leaf.grad is not None and leaf.grad.abs().sum() > 0 for leaf in leaves)


def test_fbgemm_2d_values_with_heads():
    """fbgemm's ``[total, H * D]`` values with ``heads=`` (GQA: k and v split into heads of q's D) give
    a ``(values, [offsets])`` pair with 2-D values, equal to the 3-D call; torchrec-style containers and
    bare tensors take ``heads=`` the same way."""
    q, k, v, oq, ok = _inputs(hq=4, hkv=2, dim=64)
    expected = ja.jagged_attention(q, k, v, oq, ok)
    values, [offsets] = ja.jagged_attention((q.flatten(1), [oq]), (k.flatten(1), [ok]), (v.flatten(1), [ok]), heads=4)
    assert values.shape == (q.shape[0], 4 * 64) and offsets is oq
    assert torch.equal(values, expected.flatten(1))
    jt = ja.jagged_attention(*(TorchrecStyleJT(x.flatten(1), offsets=o) for x, o in ((q, oq), (k, ok), (v, ok))),
                             heads=4)
    assert torch.equal(jt.values(), expected.flatten(1))
    assert torch.equal(ja.jagged_attention(q.flatten(1), k.flatten(1), v.flatten(1), oq, ok, heads=4),
                       expected.flatten(1))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths_q=st.lists(st.sampled_from(EDGE_LENGTHS), min_size=1, max_size=4), data=st.data(),
       heads_kv=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]))
def test_2d_pairs_over_ragged_lengths(lengths_q, data, heads_kv, group):
    """A 2-D pair call equals the 3-D call for ragged batches (empty, single-token and 32/128 boundary
    sequences, cross-attention lengths), causal, out flattened back to ``[total, Hq * D]``."""
    lengths_k = data.draw(st.lists(st.sampled_from(EDGE_LENGTHS), min_size=len(lengths_q), max_size=len(lengths_q)))
    q, k, v, oq, ok = _inputs(lengths_q, lengths_k, hq=heads_kv * group, hkv=heads_kv, dim=32)
    expected = ja.jagged_attention(q, k, v, oq, ok, causal=True)
    values, _ = ja.jagged_attention((q.flatten(1), [oq]), (k.flatten(1), [ok]), (v.flatten(1), [ok]),
                                    heads=heads_kv * group, causal=True)
    assert torch.equal(values, expected.flatten(1))


def test_real_fbgemm_pipeline_without_reshapes():
    """fbgemm's dense_to_jagged output goes in as it is and the pair that comes out goes straight back
    into fbgemm's jagged_to_padded_dense."""
    pytest.importorskip("fbgemm_gpu")
    lengths = torch.tensor([3, 0, 40, 33])
    offsets = offsets_from_lengths(lengths)
    dense = {name: torch.randn(4, 40, 2 * 64) for name in "qkv"}
    pairs = {name: (torch.ops.fbgemm.dense_to_jagged(x, [offsets])[0], [offsets]) for name, x in dense.items()}
    values, [out_offsets] = ja.jagged_attention(pairs["q"], pairs["k"], pairs["v"], heads=2, causal=True)
    padded = torch.ops.fbgemm.jagged_to_padded_dense(values, [out_offsets], [40], 0.0)
    q, k, v = (pairs[name][0].view(-1, 2, 64) for name in "qkv")
    expected = ja.jagged_attention(q, k, v, offsets, causal=True)
    assert padded.shape == (4, 40, 128) and torch.equal(padded[2, :40], expected[3:43].flatten(1))


def test_keyed_jagged_tensor_asks_for_one_key():
    q, k, v, oq, ok = _inputs()
    with pytest.raises(TypeError, match=r"KeyedJaggedTensor.*q\[key\]"):
        ja.jagged_attention(TorchrecStyleKJT(q, offsets=oq), k, v, None, ok)
    with pytest.raises(TypeError, match=r"KeyedJaggedTensor.*values\[key\]"):
        ja.quantize_mxfp8(TorchrecStyleKJT(q, offsets=oq))


@pytest.mark.parametrize("bad", [[1.0] * 32, {"values": 1}, 3.0, (torch.zeros(2, 32),)])
def test_anything_else_is_a_type_error_listing_the_accepted_kinds(bad):
    q, k, v, oq, ok = _inputs()
    kinds = r"torch.Tensor.*JaggedTensor.*nested tensor.*\(values, \[offsets\]\).*\.values\(\) and \.offsets\(\)"
    with pytest.raises(TypeError, match=kinds + r".*MXFP8Jagged; got"):
        ja.jagged_attention(bad, k, v, oq, ok)
    with pytest.raises(TypeError, match=kinds + r".*JaggedTensor\); got"):
        ja.quantize_mxfp8(bad)


def _bad_heads():
    q, k, v, oq, ok = _inputs(hq=4, hkv=2, dim=64)
    q2, k2, v2 = q.flatten(1), k.flatten(1), v.flatten(1)
    yield (q2, k2, v2, oq, ok), {}, "with heads="  # 2-D without heads
    yield (q, k, v, oq, ok), {"heads": 4}, "splits 2-D"  # 3-D with heads
    yield (q2, k2, v2, oq, ok), {"heads": 3}, "splits 2-D"  # 256 channels are not 3 heads
    yield (q2, k2[:, :96], v2[:, :96], oq, ok), {"heads": 4}, "heads of q's head_dim"
    yield (q2, k2, v2, oq, ok), {"heads": 0}, "positive int"
    yield (q2, k2, v2, oq, ok), {"heads": True}, "positive int"
    mx = (ja.quantize_mxfp8(q, oq), ja.quantize_mxfp8(k, ok), ja.quantize_mxfp8(v, ok, axis="sequence"))
    yield (*mx, None, None), {"heads": 4}, "quantize_mxfp8"


@pytest.mark.parametrize("case", range(len(list(_bad_heads()))))
def test_bad_heads(case):
    args, kwargs, match = list(_bad_heads())[case]
    with pytest.raises(ValueError, match=match):
        ja.jagged_attention(*args, **kwargs)


def test_quantize_mxfp8_takes_the_same_containers():
    """Every container ``jagged_attention`` takes quantizes bit-identically to its bare tensor and offsets;
    ``heads=`` reads 2-D values as ``[total, H, D]``, so the result feeds the attention."""
    q, _, _, oq, _ = _inputs()
    for axis in ("feature", "sequence"):
        expected = ja.quantize_mxfp8(q, oq, axis=axis)
        flat = q.flatten(1)
        for container, heads in ((ja.JaggedTensor(q, oq), None), ((q, [oq]), None),
                                 (TorchrecStyleJT(q, offsets=oq), None), (pack_attention_nested(q, oq, True), None),
                                 ((flat, [oq]), 4), (TorchrecStyleJT(flat, offsets=oq), 4)):
            mx = ja.quantize_mxfp8(container, axis=axis, heads=heads)
            assert torch.equal(mx.offsets.long(), oq) and mx.data.shape == q.shape
            assert torch.equal(mx.data.view(torch.uint8), expected.data.view(torch.uint8))
            assert torch.equal(mx.scales.view(torch.uint8), expected.scales.view(torch.uint8))
    feature, sequence = ja.quantize_mxfp8_dual((q.flatten(1), [oq]), heads=4)
    assert feature.data.shape == sequence.data.shape == q.shape


# --- backend="auto" on a GPU without a kernel path ----------------------------------------------------------------


@pytest.fixture
def gpu_capability(monkeypatch):
    """Set what ``torch.cuda.get_device_capability`` reports; the once-per-process memory starts empty."""
    backends._warn_reference_on_gpu.cache_clear()
    yield lambda capability: monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    backends._warn_reference_on_gpu.cache_clear()


def test_auto_on_a_gpu_without_kernels_warns_once(gpu_capability):
    cuda = torch.device("cuda")
    for capability, name in (((8, 9), "portable"), ((9, 0), "hopper"), ((10, 0), "block-scaled"),
                             ((12, 0), "block-scaled")):
        gpu_capability(capability)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert backends.auto_backend_name(cuda) == name
    gpu_capability((8, 6))
    with pytest.warns(UserWarning, match="runs the reference backend .* on this sm_86 GPU"):
        assert backends.auto_backend_name(cuda) == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process, whatever the warning filters say
        assert backends.auto_backend_name(cuda) == "reference"


def test_auto_warning_does_not_break_a_compiled_graph(gpu_capability):
    """The choice runs (not traced) under torch.compile: one graph, the warning once, at compile time."""
    gpu_capability((8, 0))

    def scaled(x):
        return x * (2 if backends.auto_backend_name(torch.device("cuda")) == "reference" else 3)

    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="sm_80"):
        assert torch.equal(torch.compile(scaled, fullgraph=True, backend="eager")(torch.ones(2)), torch.full((2,), 2.0))
