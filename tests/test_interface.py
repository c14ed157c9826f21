"""jagged_attention: input forms, dtypes, autograd, torch.library / torch.compile, bad input."""

import subprocess
import sys
import warnings

import pytest
import torch

import jagged_attn as ja
from gpu_util import device_to_host_copies
from jagged_attn import backends
from jagged_attn.metrics import cosine, relative_l2
from jagged_attn.offsets import offsets_from_lengths
from jagged_attn.reference import reference_backward, reference_forward


def _inputs(lengths_q=(3, 0, 40, 33), lengths_k=(50, 2, 0, 33), hq=4, hkv=2, dim=64, dtype=torch.float32):
    oq, ok = offsets_from_lengths(torch.tensor(lengths_q)), offsets_from_lengths(torch.tensor(lengths_k))
    q = torch.randn(int(oq[-1]), hq, dim, dtype=dtype)
    k = torch.randn(int(ok[-1]), hkv, dim, dtype=dtype)
    v = torch.randn(int(ok[-1]), hkv, dim, dtype=dtype)
    return q, k, v, oq, ok


def _mx(q, k, v, oq, ok):
    return ja.quantize_mxfp8(q, oq), ja.quantize_mxfp8(k, ok), ja.quantize_mxfp8(v, ok, axis="sequence")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_high_precision_forward_backward_match_reference(dtype):
    q, k, v, oq, ok = _inputs(dtype=dtype)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out, lse = ja.jagged_attention(*leaves, oq, ok, causal=True, return_lse=True, center_kv=False)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    deq = [m.dequantize() for m in _mx(q, k, v, oq, ok)]
    ref_out, ref_lse = reference_forward(*deq, oq, ok, causal=True)
    assert torch.equal(out, ref_out.to(dtype)) and torch.equal(lse, ref_lse)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref_grads = reference_backward(dout, q, k, v, out.detach(), lse, oq, ok, causal=True)
    for leaf, g in zip(leaves, ref_grads):
        assert leaf.grad.dtype == dtype and torch.equal(leaf.grad, g.to(dtype))


def test_mxfp8_inputs_and_other_forms_agree():
    q, k, v, oq, ok = _inputs()
    mq, mk, mv = _mx(q, k, v, oq, ok)
    out_mx = ja.jagged_attention(mq, mk, mv)
    assert out_mx.dtype == torch.bfloat16
    out = ja.jagged_attention(q, k, v, oq, ok, center_kv=False)  # as quantize_mxfp8 rounds them
    assert torch.equal(out_mx, out.to(torch.bfloat16))
    jagged = ja.jagged_attention(ja.JaggedTensor(q, oq), ja.JaggedTensor(k, ok), ja.JaggedTensor(v, ok))
    fbgemm_values, [fbgemm_offsets] = ja.jagged_attention((q, [oq]), (k, [ok]), (v, [ok]))
    assert isinstance(jagged, ja.JaggedTensor) and torch.equal(jagged.values, out) and jagged.offsets is oq
    assert torch.equal(fbgemm_values, out) and fbgemm_offsets is oq


def test_self_attention_defaults_and_scale():
    q, _, _, oq, _ = _inputs(lengths_k=(3, 0, 40, 33))
    k, v = torch.randn_like(q[:, :2]), torch.randn_like(q[:, :2])
    out = ja.jagged_attention(q, k, v, oq, softmax_scale=0.125)
    assert torch.equal(out, ja.jagged_attention(q, k, v, oq, oq))  # 0.125 = 1/sqrt(64)
    assert not torch.equal(out, ja.jagged_attention(q, k, v, oq, softmax_scale=0.5))


def test_torch_library_opcheck():
    q, k, v, oq, ok = _inputs(lengths_q=(5, 33), lengths_k=(7, 31), hq=2, hkv=1, dim=32)
    args = [x.requires_grad_(True) for x in (q, k, v)] + [oq, ok, True, 0.2, "reference", False, "sequence", True]
    torch.library.opcheck(torch.ops.jagged_attn.attention.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    out, lse = (t.detach() for t in torch.ops.jagged_attn.attention(*args))
    for dlse in (None, torch.randn_like(lse)):
        backward_args = [torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, oq, ok, True, 0.2,
                         "reference", False, dlse]
        torch.library.opcheck(torch.ops.jagged_attn.attention_backward.default, backward_args,
                              test_utils=("test_schema", "test_faketensor"))


def test_import_registers_the_torch_library_ops():
    """``import jagged_attn`` alone makes ``torch.ops.jagged_attn.*`` available (a fresh process: in this
    one earlier tests have called them); they were once registered on the first call."""
    script = ("import torch, jagged_attn\n"
              "for name in ('attention', 'mxfp8_attention', 'attention_backward', 'linear_quantize',\n"
              "             'rms_norm_quantize', 'prequantized_attention'):\n"
              "    getattr(torch.ops.jagged_attn, name)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_torch_compile_fullgraph_forward_backward():
    q, k, v, oq, ok = _inputs()
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    compiled = torch.compile(lambda a, b, c: ja.jagged_attention(a, b, c, oq, ok, causal=True), fullgraph=True,
                             backend="aot_eager")
    out = compiled(*leaves)
    assert torch.equal(out, ja.jagged_attention(q, k, v, oq, ok, causal=True))
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in leaves)


@pytest.mark.parametrize("with_dout", [False, True])
def test_gradient_through_lse(with_dout):
    """The LSE is differentiable: a loss of the LSE (alone, or with O) gives the gradients of
    ``reference_backward`` with ``dlse`` on the same inputs, bit for bit; rows that see no key (causal,
    L_q > L_k) give no gradient whatever their dLSE holds (inf, NaN: zeros, not NaN)."""
    q, k, v, oq, ok = _inputs(lengths_q=(3, 0, 40, 33), lengths_k=(50, 2, 0, 20))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out, lse = ja.jagged_attention(*leaves, oq, ok, causal=True, return_lse=True, center_kv=False)
    unseen = torch.isneginf(lse)
    assert unseen.any() and not unseen.all()
    dout = torch.randn_like(out) if with_dout else torch.zeros_like(out)
    dlse = torch.randn_like(lse)
    dlse_given = dlse.masked_fill(unseen, float("nan"))
    dlse_given[tuple(unseen.nonzero()[0])] = float("inf")
    outputs, grad_outputs = ((out, lse), (dout, dlse_given)) if with_dout else ((lse,), (dlse_given,))
    grads = torch.autograd.grad(outputs, leaves, grad_outputs)
    expected = reference_backward(dout, q, k, v, out.detach(), lse.detach(), oq, ok, causal=True,
                                  dlse=dlse.masked_fill(unseen, 0.0))
    for g, e in zip(grads, expected):
        assert torch.equal(g, e)
    assert grads[0].any() and bool(grads[2].any()) == with_dout  # dV = P^T dO: nothing from the LSE


def test_lse_gradient_under_torch_compile():
    q, k, v, oq, ok = _inputs()
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]

    def loss(a, b, c):
        out, lse = ja.jagged_attention(a, b, c, oq, ok, causal=True, return_lse=True)
        return out.square().sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    eager = torch.autograd.grad(loss(*leaves), leaves)
    for g, e in zip(torch.autograd.grad(compiled(*leaves), leaves), eager):
        assert torch.equal(g, e)


def test_backward_passes_no_lse_gradient_the_loss_does_not_use(monkeypatch):
    """When the loss uses only O the backward gets no LSE gradient (None, not a zeros tensor): Delta is
    formed as without ``return_lse``, at no extra cost."""
    from jagged_attn import reference

    seen = []
    softmax_delta = reference.softmax_delta
    monkeypatch.setattr(reference, "softmax_delta", lambda *args: seen.append(args[2]) or softmax_delta(*args))
    q, k, v, oq, ok = _inputs()
    leaves = [x.requires_grad_(True) for x in (q, k, v)]
    out, lse = ja.jagged_attention(*leaves, oq, ok, return_lse=True)
    out.sum().backward()
    assert seen == [None] and all(torch.isfinite(x.grad).all() for x in leaves)


def test_auto_backend_on_cpu_is_reference():
    assert backends.auto_backend_name(torch.device("cpu")) == "reference"


def test_kernel_backends_refuse_cpu_without_interpreter(monkeypatch):
    monkeypatch.setattr(backends, "_interpreting", lambda: False)
    q, k, v, oq, ok = _inputs()
    for name in ("hopper-exact-scores", "hopper", "block-scaled", "portable"):
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            ja.jagged_attention(q, k, v, oq, ok, backend=name)


def test_backends_pick_the_backward_scores(monkeypatch):
    """``hopper-exact-scores`` asks the Hopper backward for exact S (bf16 MMA), ``hopper`` for FP8 S, as their
    forwards."""
    from jagged_attn.kernels.sm90 import backward as sm90_backward

    calls = []
    monkeypatch.setattr(sm90_backward, "attention_backward", lambda *args, **kwargs: calls.append(kwargs))
    q, k, v, oq, ok = _inputs()
    for name in ("hopper-exact-scores", "hopper"):
        backends.get_backend(name).backward(q, q, k, v, q, q[..., 0], oq, ok, False, 0.125, False)
    assert [c["scores"] for c in calls] == ["bf16", "fp8"]


@pytest.fixture
def fresh_deprecation_warnings():
    """The once-per-process memory of deprecated backend names starts (and ends) empty."""
    backends._warn_deprecated_name.cache_clear()
    yield
    backends._warn_deprecated_name.cache_clear()


def test_deprecated_backend_names_resolve_with_one_warning(fresh_deprecation_warnings, monkeypatch):
    """The previous release's names run the backend now called by the new name, warning (at the caller's
    line) once per name per process; the new names and ``auto`` resolve quietly, anything else is refused."""
    monkeypatch.setattr(backends, "_interpreting", lambda: False)  # stop at the device check, naming the backend
    q, k, v, oq, ok = _inputs()
    assert backends.DEPRECATED_NAMES == {"triton": "hopper-exact-scores", "triton-fast": "hopper",
                                         "exact": "block-scaled"}
    for old, new in backends.DEPRECATED_NAMES.items():
        assert new in backends.BACKENDS and old not in backends.BACKENDS
        with pytest.warns(DeprecationWarning, match=f"backend={old!r} is deprecated .* now called {new!r}") as seen:
            with pytest.raises(ValueError, match=f"backend={new!r} needs a CUDA GPU"):
                ja.jagged_attention(q, k, v, oq, ok, backend=old)
        assert [w.filename for w in seen] == [__file__]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per process, whatever the warning filters say
            assert backends.backend_name(old) == new
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in backends.BACKENDS:
            assert backends.backend_name(name) == name
    with pytest.raises(ValueError, match="backend must be one of"):
        ja.jagged_attention(q, k, v, oq, ok, backend="cuda")


def test_deprecated_backend_name_under_torch_compile(fresh_deprecation_warnings):
    """An old name resolves (run, not traced) under a fullgraph torch.compile: one graph, the warning once."""
    def scaled(x):
        return x * (2 if backends.backend_name("triton-fast") == "hopper" else 3)

    torch._dynamo.reset()
    with pytest.warns(DeprecationWarning, match="'triton-fast' is deprecated"):
        assert torch.equal(torch.compile(scaled, fullgraph=True, backend="eager")(torch.ones(2)), torch.full((2,), 2.0))


def test_layer_keeps_the_new_backend_name(fresh_deprecation_warnings):
    from jagged_attn.nn import JaggedAttention

    with pytest.warns(DeprecationWarning, match="'exact' is deprecated"):
        layer = JaggedAttention(64, num_heads=2, backend="exact")
    assert layer.backend == "block-scaled"


def _bad_calls():
    q, k, v, oq, ok = _inputs()
    mq, mk, mv = _mx(q, k, v, oq, ok)
    yield (q, k, v, None, ok), {}, ValueError, "offsets_q is required"
    yield (q, k, v, oq, ok[:-1]), {}, ValueError, "offsets_k"
    yield (q, k, v, oq, offsets_from_lengths(torch.tensor([50, 2, 33]))), {}, ValueError, "same batch size"
    yield (q, k, v, oq.float(), ok), {}, TypeError, "offsets_q must be int32 or int64"
    yield (q, k, v, torch.tensor([0, 40, 30, 76]), ok), {}, ValueError, "non-decreasing"
    yield (q, k[:, :1].repeat(1, 3, 1), v[:, :1].repeat(1, 3, 1), oq, ok), {}, ValueError, "multiple of k/v heads"
    yield (q[..., :48], k[..., :48], v[..., :48], oq, ok), {}, ValueError, "multiple of 32"
    yield (q, k, v[..., :32], oq, ok), {}, ValueError, "same shape"
    yield (q, k.double(), v, oq, ok), {}, TypeError, "k must be float32"
    yield (q, k.half(), v.half(), oq, ok), {}, TypeError, "share a dtype"
    yield (q.clone().fill_(float("inf")), k, v, oq, ok), {}, ValueError, "q contains NaN or Inf"
    yield (q, k, v.clone().fill_(float("nan")), oq, ok), {}, ValueError, "v contains NaN or Inf"
    yield (q, k, v, oq, ok), {"backend": "cudnn"}, ValueError, "backend must be one of"
    yield (q, k, v, oq, ok), {"softmax_scale": -1.0}, ValueError, "softmax_scale"
    yield (q, k, v, oq, ok), {"softmax_scale": float("nan")}, ValueError, "softmax_scale"
    yield (q, k, v, oq), {}, ValueError, "offsets_k is required"
    yield (mq, mk, v, None, None), {}, TypeError, "all MXFP8Jagged"
    yield ((mq, mk, ja.quantize_mxfp8(v, ok), None, None), {"backend": "portable"}, ValueError,
           "per-token V scales")
    yield (q, k, v, oq, ok), {"backend": "hopper"}, ValueError, "which the Triton CPU interpreter cannot run"
    yield (q, k, v, oq, ok), {"v_scaling": "channel"}, ValueError, "v_scaling must be one of"
    k_seq = ja.quantize_mxfp8(k, ok, axis="sequence")
    yield (mq, k_seq, mv, None, None), {}, ValueError, "k must be quantized along the feature"
    yield (mk, mq, mv, None, None), {}, ValueError, "v.offsets must equal"
    yield (q, k, v, oq, ok.to("meta")), {}, ValueError, "offsets_k"
    yield (q.to("meta"), k, v, oq, ok), {}, ValueError, "same device"
    # Arguments once taken at their truthiness, or run with other offsets than given:
    yield (q, k, v, oq, ok), {"causal": "no"}, TypeError, "causal must be a bool"
    yield (q, k, v, oq, ok), {"deterministic": 1}, TypeError, "deterministic must be a bool"
    yield (q, k, v, oq, ok), {"softmax_scale": True}, ValueError, "softmax_scale"
    other = offsets_from_lengths(torch.tensor([40, 10, 26]))
    yield (q, q, ja.JaggedTensor(q, other), oq, None), {}, ValueError, "v's offsets must equal k's"
    # Head dims a backend's kernels lack: refused before any kernel is compiled.
    wide = _inputs(dim=96)
    yield wide, {"backend": "portable"}, ValueError, "supports head_dim in"
    yield wide, {"backend": "block-scaled"}, ValueError, "supports head_dim in"



@pytest.mark.parametrize("case", range(len(list(_bad_calls()))))
def test_bad_input(case):
    args, kwargs, error, match = list(_bad_calls())[case]
    with pytest.raises(error, match=match):
        ja.jagged_attention(*args, **kwargs)


def test_the_reference_backend_takes_any_head_dim_multiple_of_32():
    q, k, v, oq, ok = _inputs(dim=96)
    out = ja.jagged_attention(q, k, v, oq, ok, backend="reference")
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_value_checks_off_skips_only_the_checks_that_read_values():
    """Inside ``value_checks(False)`` NaN inputs go through unchecked (what comes out is then
    undefined), dtype checks still raise, a nested ``value_checks(True)`` turns them back on, and so
    does leaving the block."""
    q, k, v, oq, ok = _inputs()
    nan_q = q.clone()
    nan_q[1, 0, 5] = float("nan")
    with ja.value_checks(False):
        assert ja.jagged_attention(nan_q, k, v, oq, ok).shape == q.shape
        assert ja.quantize_mxfp8(nan_q, oq).data.shape == q.shape
        with pytest.raises(TypeError, match="share a dtype"):
            ja.jagged_attention(q, k.half(), v.half(), oq, ok)
        with ja.value_checks(True), pytest.raises(ValueError, match="q contains NaN or Inf"):
            ja.jagged_attention(nan_q, k, v, oq, ok)
    for call in (lambda: ja.jagged_attention(nan_q, k, v, oq, ok), lambda: ja.quantize_mxfp8(nan_q, oq)):
        with pytest.raises(ValueError, match="NaN or Inf"):
            call()


def test_offsets_are_read_once_until_written(monkeypatch):
    """validate_offsets reads an offsets tensor's facts from the device once; again only for other rows
    or after an in-place write (its version counter), which can make it invalid. The longest sequence
    comes with them (``known_longest``), for as long as they hold."""
    from jagged_attn import interface, offsets as offsets_module

    reads = []
    facts = offsets_module.offsets_facts
    for module in (offsets_module, interface):
        monkeypatch.setattr(module, "offsets_facts", lambda o: reads.append(1) or facts(o))
    offsets = offsets_from_lengths(torch.tensor([3, 0, 5]))
    assert offsets_module.known_longest(offsets, 8) is None
    for _ in range(3):
        offsets_module.validate_offsets(offsets, 8)
    assert len(reads) == 1
    assert offsets_module.known_longest(offsets, 8) == 5 and offsets_module.known_longest(offsets, 9) is None
    with pytest.raises(ValueError, match="must equal the number of rows"):
        offsets_module.validate_offsets(offsets, 9)
    assert len(reads) == 2
    offsets[1] = 6  # 0, 6, 3, 8: now decreasing
    assert offsets_module.known_longest(offsets, 8) is None
    with pytest.raises(ValueError, match="non-decreasing"):
        offsets_module.validate_offsets(offsets, 8)
    q, k, v, oq, ok = _inputs()
    ja.jagged_attention(q, k, v, oq, ok)
    ja.jagged_attention(q, k, v, oq, ok)
    assert len(reads) == 5  # offsets_q and offsets_k, once each
    with torch.inference_mode():  # inference tensors keep no version counter: read at every validation
        oq, ok = oq.clone(), ok.clone()
        ja.jagged_attention(q, k, v, oq, ok)
        first = len(reads) - 5
        ja.jagged_attention(q, k, v, oq, ok)
        assert first >= 2 and len(reads) - 5 == 2 * first
        oq[1] = 4  # 0, 4, 3, ...
        with pytest.raises(ValueError, match="non-decreasing"):
            ja.jagged_attention(q, k, v, oq, ok)


def test_token_scaled_v_rules_out_causal_leakage():
    """With v_scaling="token", a future token's V cannot change an earlier output, even by rounding."""
    q, k, v, oq, ok = _inputs(lengths_q=(64,), lengths_k=(64,), hq=1, hkv=1, dim=32)
    v_bumped = v.clone()
    v_bumped[40] *= 1000.0  # inside the 32-token block [32, 64) of queries 32..39
    for v_scaling, leaks in (("sequence", True), ("token", False)):
        a = ja.jagged_attention(q, k, v, oq, causal=True, v_scaling=v_scaling, center_kv=False)
        b = ja.jagged_attention(q, k, v_bumped, oq, causal=True, v_scaling=v_scaling, center_kv=False)
        assert torch.equal(a[:40], b[:40]) != leaks, v_scaling
    mx_v = ja.quantize_mxfp8(v, ok, axis="feature")
    out = ja.jagged_attention(ja.quantize_mxfp8(q, oq), ja.quantize_mxfp8(k, ok), mx_v, causal=True)
    assert torch.equal(out, ja.jagged_attention(q, k, v, oq, causal=True, v_scaling="token", center_kv=False).to(
        torch.bfloat16))


@pytest.mark.parametrize("heads_first", [False, True])
def test_nested_tensors_in_and_out_match_sdpa(heads_first):
    """Jagged nested tensors (either attention layout) go in and come out, and agree with torch's SDPA
    on the same nested tensors up to the MXFP8 quantization error."""
    import torch.nn.functional as F

    from jagged_attn.jagged import pack_attention_nested

    q, k, v, oq, _ = _inputs(lengths_q=(3, 40, 33), lengths_k=(3, 40, 33), hq=2, hkv=2, dim=32)
    nq, nk, nv = (pack_attention_nested(x, oq, heads_first) for x in (q, k, v))
    out = ja.jagged_attention(nq, nk, nv)
    assert out.is_nested and out.shape[:2] == nq.shape[:2]
    sdpa_in = [x if heads_first else x.transpose(1, 2) for x in (nq, nk, nv)]
    ref = F.scaled_dot_product_attention(*sdpa_in)
    ref_values = ref.transpose(1, 2).values()  # SDPA works in [B, H, j, D]
    ours = (out.transpose(1, 2) if heads_first else out).values()
    assert relative_l2(ours, ref_values) < 8e-2 and cosine(ours, ref_values) > 0.995
    with pytest.raises(ValueError, match="carries its own offsets"):
        ja.jagged_attention(nq, nk, nv, oq)


@pytest.mark.gpu
@pytest.mark.parametrize("backend, dtype", [("auto", torch.bfloat16), ("auto", torch.float16), ("auto", torch.float32),
                                            ("hopper", torch.bfloat16), ("hopper", torch.float32),
                                            ("block-scaled", torch.bfloat16), ("portable", torch.bfloat16)])
def test_gpu_backends_through_the_public_api(backend, dtype):
    """jagged_attention on CUDA (auto = hopper on Hopper): forward, LSE and gradients against the
    reference backend on the same inputs (Gaussian, ragged, cross, causal, GQA), in the inputs' dtype
    (fp32 gradients once went wrong where bf16 ones were right: docs/perf-history.md v19)."""
    q, k, v, oq, ok = _inputs(lengths_q=(0, 1, 31, 129, 700), lengths_k=(5, 64, 33, 128, 900), hq=8, hkv=2,
                              dim=128, dtype=dtype)
    q, k, v, oq, ok = (x.cuda() for x in (q, k, v, oq, ok))
    dout = torch.randn_like(q)
    results = {}
    for name in (backend, "reference"):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out, lse = ja.jagged_attention(*leaves, oq, ok, causal=True, backend=name, return_lse=True)
        out.backward(dout)
        results[name] = (out, lse, *(x.grad for x in leaves))
    names = ("out", "lse", "dq", "dk", "dv")
    limits = (1e-2, 1e-3, 2e-2, 2e-2, 2e-2)
    for name, got, ref, limit in zip(names, results[backend], results["reference"], limits):
        assert got.dtype == (torch.float32 if name == "lse" else dtype), name
        seen = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(got), seen), name
        assert relative_l2(got[seen], ref[seen]) < limit, name


@pytest.mark.gpu
@pytest.mark.parametrize("checks, waits", [(True, 1), (False, 0)])
def test_gpu_training_step_waits_for_the_device_once(checks, waits):
    """A forward + backward of jagged_attention (backend hopper-exact-scores, bf16) copies from the device to the
    host once: the validation's one read of the offsets' facts and the inputs' finiteness; never
    inside ``value_checks(False)``. Every wait leaves the GPU idle while the host launches what follows
    (making nine waits one took an H200's step from 30.98 to 28.76 ms, docs/perf-history.md v15); the kernels'
    own launches need none."""
    q, k, v, oq, ok = (x.cuda() for x in _inputs(lengths_q=(0, 1, 129, 700), lengths_k=(5, 64, 128, 900), hq=4,
                                                 hkv=2, dim=128, dtype=torch.bfloat16))
    leaves = [x.requires_grad_(True) for x in (q, k, v)]

    def step():
        out = ja.jagged_attention(*leaves, oq, ok, causal=True, backend="hopper-exact-scores")
        return torch.autograd.grad(out, leaves, torch.randn_like(q))

    copies = device_to_host_copies(step, value_checks=checks)
    assert len(copies) == waits, copies


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_gpu_nonfinite_input_raises_once_offsets_are_known(name):
    """Once its offsets are known valid, a call sends the NaN/Inf check to the host in a copy queued
    behind the reductions and reads it after queuing its kernels; it still raises, naming the tensor."""
    q, k, v, oq, ok = (x.cuda() for x in _inputs(lengths_q=(3, 130), lengths_k=(40, 7), hq=2, hkv=1, dim=64,
                                                 dtype=torch.bfloat16))
    inputs = {"q": q, "k": k, "v": v}
    ja.jagged_attention(q, k, v, oq, ok, backend="hopper-exact-scores")  # the offsets become known valid
    bad = inputs[name].clone()
    bad[int(torch.randint(bad.shape[0], ()))] = float("nan") if torch.rand(()) < 0.5 else float("inf")
    inputs[name] = bad
    with pytest.raises(ValueError, match=f"{name} contains NaN or Inf"):
        ja.jagged_attention(*inputs.values(), oq, ok, backend="hopper-exact-scores")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_inputs_on_another_gpu_than_the_current_one():
    """Triton launches on the current device, so the entry points make their inputs' device current: a
    call on cuda:1 while cuda:0 is current gives, bit for bit, what it gives with cuda:1 current
    (attention forward and backward, quantize_mxfp8, the layer's fused producers)."""
    from jagged_attn.nn import JaggedAttention

    q, k, v, oq, ok = (x.to("cuda:1") for x in _inputs(lengths_q=(3, 130), lengths_k=(40, 7), hq=2, hkv=1, dim=64,
                                                         dtype=torch.bfloat16))
    dout = torch.randn_like(q)
    layer = JaggedAttention(128, num_heads=2, head_dim=64).to("cuda:1", torch.bfloat16)
    x = torch.randn(q.shape[0], 128, device="cuda:1", dtype=torch.bfloat16)

    def run():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = ja.jagged_attention(*leaves, oq, ok, causal=True, backend="hopper-exact-scores", deterministic=True)
        mx = ja.quantize_mxfp8(q, oq)
        return [out, *torch.autograd.grad(out, leaves, dout), mx.data.view(torch.uint8), mx.scales.view(torch.uint8),
                layer(x, oq)]

    with torch.cuda.device(1):
        expected = run()
    with torch.cuda.device(0):
        got = run()
    for a, b in zip(got, expected):
        assert a.device == torch.device("cuda:1") and torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("batch, longest, heads, dim, past_int32",
                         [(100_000, 21, 2, 64, False), (8_000, 273, 16, 128, True)])
def test_gpu_large_batches(batch, longest, heads, dim, past_int32):
    """100,000 sequences; and ~1.1M tokens x 16 heads x 128, whose element offsets pass 2^31. Forward
    and backward through the public API (backend "auto" = hopper on Hopper) on the whole batch,
    checked against the reference backend on the first and last 40 sequences (attention is per
    sequence). The transposed copies pad every sequence to whole 128-token slots, so the large batch has
    sequences of ~137 tokens on average (20,000 of ~55 needed more than an H100's 80 GB)."""
    lengths = torch.randint(1, longest + 1, (batch,))
    lengths[-1] = 700  # one long sequence at the far end
    offsets = offsets_from_lengths(lengths).cuda()
    total = int(offsets[-1])
    assert (total * heads * dim >= 2**31) == past_int32
    q, k, v = (torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn_like(q)
    leaves = [x.requires_grad_(True) for x in (q, k, v)]
    out = ja.jagged_attention(*leaves, offsets, causal=True)
    out.backward(dout)
    for first, last in ((0, 40), (batch - 40, batch)):
        rows = slice(int(offsets[first]), int(offsets[last]))
        part = offsets[first:last + 1] - offsets[first]
        sliced = [x.detach()[rows].clone().requires_grad_(True) for x in (q, k, v)]
        ref = ja.jagged_attention(*sliced, part, causal=True, backend="reference")
        ref.backward(dout[rows])
        for got, want in zip((out[rows], q.grad[rows], k.grad[rows], v.grad[rows]),
                             (ref, *(x.grad for x in sliced))):
            assert not torch.isnan(got).any()
            assert relative_l2(got, want) < 2e-2
