"""JaggedAttention module: against an unquantized fp64 twin, training on a ragged task, compile."""

import pytest
import torch

import jagged_attn as ja
from attention_oracle import padded_attention
from gpu_util import device_to_host_copies
from jagged_attn.metrics import cosine, relative_l2
from jagged_attn.nn import JaggedAttention
from jagged_attn.offsets import offsets_from_lengths


def _twin_output(twin, x, offsets, context=None, offsets_kv=None, attention_dtype=None):
    """The same layer from plain torch ops, attention unquantized (padded; in ``attention_dtype``
    if given, else the projections' dtype)."""
    source = x if context is None else context
    offsets_kv = offsets if offsets_kv is None else offsets_kv
    q = twin.q_proj(x).unflatten(-1, (twin.num_heads, twin.head_dim))
    k = twin.k_proj(source).unflatten(-1, (twin.num_kv_heads, twin.head_dim))
    v = twin.v_proj(source).unflatten(-1, (twin.num_kv_heads, twin.head_dim))
    if twin.qk_norm:
        q, k = twin.q_norm(q), twin.k_norm(k)
    dtype = q.dtype if attention_dtype is None else attention_dtype
    out, _ = padded_attention(q.to(dtype), k.to(dtype), v.to(dtype), offsets, offsets_kv, twin.causal)
    return twin.out_proj(out.to(q.dtype).flatten(-2))


@pytest.mark.parametrize("causal, qk_norm, cross", [(True, False, False), (False, True, True)])
def test_matches_unquantized_fp64_twin(causal, qk_norm, cross):
    config = dict(num_heads=4, num_kv_heads=2, head_dim=32, kv_dim=48 if cross else None, causal=causal,
                  qk_norm=qk_norm)
    layer = JaggedAttention(96, **config)
    twin = JaggedAttention(96, **config, dtype=torch.float64)
    twin.load_state_dict({name: p.double() for name, p in layer.state_dict().items()})
    offsets = offsets_from_lengths(torch.tensor([0, 1, 33, 129, 60]))
    x = torch.randn(int(offsets[-1]), 96, requires_grad=True)
    x64 = x.detach().double().requires_grad_(True)
    kwargs, kwargs64 = {}, {}
    if cross:
        offsets_kv = offsets_from_lengths(torch.tensor([5, 0, 40, 31, 200]))
        context = torch.randn(int(offsets_kv[-1]), 48)
        kwargs, kwargs64 = dict(context=context, offsets_kv=offsets_kv), dict(context=context.double(),
                                                                                offsets_kv=offsets_kv)
    out, ref = layer(x, offsets, **kwargs), _twin_output(twin, x64, offsets, **kwargs64)
    assert relative_l2(out, ref) < 8e-2 and cosine(out, ref) > 0.995
    out.square().sum().backward()
    ref.square().sum().backward()
    # dQ and dK pass through the quantized dS, dO and sequence-axis Q/K: 0.12-0.25 relative L2
    # (cosine down to 0.970) at head_dim 32 over ~100 random draws; V and output-projection
    # gradients are much closer.
    for (name, p), p64 in zip(layer.named_parameters(), twin.parameters()):
        assert relative_l2(p.grad, p64.grad) < 0.4 and cosine(p.grad, p64.grad) > 0.94, name
    assert relative_l2(x.grad, x64.grad) < 0.15


def _running_mean_task(batch=4, max_len=48):
    """Ragged batch whose target is each token's running mean of feature 0 within its sequence."""
    offsets = offsets_from_lengths(torch.randint(1, max_len, (batch,)))
    x = torch.randn(int(offsets[-1]), 64)
    target = torch.cat([3 * x[s:e, 0].cumsum(0) / torch.arange(1, e - s + 1)
                        for s, e in zip(offsets[:-1].tolist(), offsets[1:].tolist())])
    return x, offsets, target


def test_training_on_a_ragged_task_reduces_the_loss():
    layer = JaggedAttention(64, num_heads=2, head_dim=32, causal=True)
    readout = torch.nn.Linear(64, 1)
    opt = torch.optim.Adam([*layer.parameters(), *readout.parameters()], lr=1e-2)

    def loss_on(x, offsets, target):
        return torch.nn.functional.mse_loss(readout(layer(x, offsets)).squeeze(-1), target)

    held_out = _running_mean_task(batch=8)
    with torch.no_grad():
        before = loss_on(*held_out).item()
    for _ in range(80):  # held-out loss after 80 steps: 0.10-0.21 of the start over 12 seeds
        loss = loss_on(*_running_mean_task())
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = loss_on(*held_out).item()
    assert after < 0.5 * before, (before, after)


def test_compile_and_repr_and_bad_config():
    layer = JaggedAttention(64, num_heads=2, head_dim=32, causal=True)
    assert "num_heads=2" in repr(layer) and "causal=True" in repr(layer)
    offsets = offsets_from_lengths(torch.tensor([3, 40]))
    x = torch.randn(43, 64)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, offsets), layer(x, offsets))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        JaggedAttention(64, num_heads=3, num_kv_heads=2)
    with pytest.raises(ValueError, match="multiple of 32"):
        JaggedAttention(64, num_heads=4, head_dim=16)
    with pytest.raises(ValueError, match="together"):
        layer(x, offsets, context=x)


def _train(layer, readout, loss_of, batches, lr=3e-3):
    """Adam on ``batches``; returns the loss of every step."""
    opt = torch.optim.Adam([*layer.parameters(), *readout.parameters()], lr=lr)
    losses = []
    for x, offsets, target in batches:
        loss = loss_of(layer, readout, x, offsets, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.gpu
@pytest.mark.parametrize("fused_producers", [False, True])
def test_gpu_training_tracks_the_bf16_curve(fused_producers):
    """The running-mean task on CUDA: the layer with the fast kernels (producers fused or not)
    against the same bf16 layer whose attention is unquantized (fp32 padded attention), same
    initial weights, same batches."""
    torch.manual_seed(torch.initial_seed() % 2**31)
    device, dtype = "cuda", torch.bfloat16
    layer = JaggedAttention(64, num_heads=2, head_dim=64, causal=True, backend="hopper-exact-scores",
                            fused_producers=fused_producers, center_kv=not fused_producers, device=device,
                            dtype=dtype)
    twin = JaggedAttention(64, num_heads=2, head_dim=64, causal=True, device=device, dtype=dtype)
    twin.load_state_dict(layer.state_dict())
    readout = torch.nn.Linear(64, 1, device=device, dtype=dtype)
    twin_readout = torch.nn.Linear(64, 1, device=device, dtype=dtype)
    twin_readout.load_state_dict(readout.state_dict())
    batches = [tuple(t.to(device) for t in _running_mean_task(batch=16, max_len=200)) for _ in range(150)]
    batches = [(x.to(dtype), offsets, target.to(dtype)) for x, offsets, target in batches]

    def ours(module, head, x, offsets, target):
        return torch.nn.functional.mse_loss(head(module(x, offsets)).squeeze(-1).float(), target.float())

    def bf16(module, head, x, offsets, target):
        out = _twin_output(module, x, offsets, attention_dtype=torch.float32)
        return torch.nn.functional.mse_loss(head(out).squeeze(-1).float(), target.float())

    curve, twin_curve = _train(layer, readout, ours, batches), _train(twin, twin_readout, bf16, batches)
    tail, twin_tail = sum(curve[-20:]) / 20, sum(twin_curve[-20:]) / 20
    print(f"[training fused_producers={fused_producers}] first {curve[0]:.3f} / {twin_curve[0]:.3f}, "
          f"last-20 mean ours {tail:.4f}, bf16 {twin_tail:.4f}")
    assert tail < 0.05 * curve[0] and twin_tail < 0.05 * twin_curve[0]
    # On CPU with the reference backend (same quantization) this tail sits at ~1.5x the twin's.
    assert tail < 2 * twin_tail + 0.005 * curve[0]


def test_autocast_bf16_matches_fp32():
    layer = JaggedAttention(64, num_heads=2, head_dim=32, causal=True)
    offsets = offsets_from_lengths(torch.tensor([7, 0, 50]))
    x = torch.randn(57, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x, offsets)
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in layer.parameters())
    ref = layer(x.detach(), offsets)
    assert relative_l2(out, ref) < 5e-2 and cosine(out, ref) > 0.998


@pytest.mark.parametrize("fused_producers", [None, True])
def test_distributed_data_parallel_and_meta_init(tmp_path, fused_producers):
    """DDP (gloo, one process) gives the plain layer's gradients; a meta-device layer materializes
    with ``to_empty`` + ``reset_parameters`` as FSDP-style deferred init does. The fused producers
    (bf16) through the same."""
    import torch.distributed as dist

    config = dict(num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True, fused_producers=fused_producers,
                  center_kv=not fused_producers)
    dtype = torch.bfloat16 if fused_producers else torch.float32
    layer = JaggedAttention(64, **config, dtype=dtype)
    offsets = offsets_from_lengths(torch.tensor([3, 33, 0, 20]))
    x = torch.randn(56, 64, dtype=dtype)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(layer)
        ddp(x, offsets).square().sum().backward()
        grads = [p.grad.clone() for p in layer.parameters()]
        layer.zero_grad()
        layer(x, offsets).square().sum().backward()
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, layer.parameters()))
    finally:
        dist.destroy_process_group()
    deferred = JaggedAttention(64, **config, device="meta", dtype=dtype)
    deferred.to_empty(device="cpu")
    for module in deferred.modules():
        if module is not deferred and hasattr(module, "reset_parameters"):
            module.reset_parameters()
    deferred.load_state_dict(layer.state_dict())
    torch.testing.assert_close(deferred(x, offsets), layer(x, offsets))


# Fused producers: on CPU the producer kernels and the Hopper forward run in the Triton interpreter.

def _bf16_pair(fused_config, **config):
    """A bf16 layer with ``fused_producers=True`` and the same layer (same weights) with False."""
    pair = dict(center_kv=False, dtype=torch.bfloat16)
    fused = JaggedAttention(96, **config, **fused_config, fused_producers=True, **pair)
    plain = JaggedAttention(96, **config, **fused_config, fused_producers=False, **pair)
    plain.load_state_dict(fused.state_dict())
    return fused, plain


def _output_and_grads(layer, x, offsets, **kwargs):
    out = layer(x, offsets, **kwargs)
    leaves = [x, *layer.parameters()]
    return out, torch.autograd.grad(out.float().square().sum(), leaves)


def _calls_of(monkeypatch, name):
    """Count the calls of ``fused_ops.<name>`` (the layer looks it up at each forward)."""
    from jagged_attn import fused_ops

    calls, op = [], getattr(fused_ops, name)
    monkeypatch.setattr(fused_ops, name, lambda *args: calls.append(1) or op(*args))
    return calls


@pytest.mark.parametrize("qk_norm", [False, True])
def test_fused_layer_rejects_nonfinite_projections(qk_norm):
    """The fused path's producers run without their own checks (fused_ops' docstring): their flags of q
    and k and V's from its quantization are read by the attention op, which names the first non-finite
    one; ``value_checks(False)`` skips that."""
    fused, _ = _bf16_pair(dict(backend="reference", qk_norm=qk_norm), num_heads=2, head_dim=64)
    offsets = offsets_from_lengths(torch.tensor([3, 40]))
    x = torch.randn(43, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        fused.k_proj.weight[5, 7] = float("inf")
    with pytest.raises(ValueError, match="k contains NaN or Inf"):
        fused(x, offsets)
    with torch.no_grad():
        fused.k_proj.weight[5, 7] = 0.0
        fused.v_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="v contains NaN or Inf"):
        fused(x, offsets)
    with ja.value_checks(False):
        assert fused(x, offsets).shape == x.shape


def test_fused_layer_rejects_offsets_on_another_device():
    """The fused path hands the offsets to its producer kernels: they must be on x's device."""
    fused, _ = _bf16_pair(dict(backend="reference"), num_heads=2, head_dim=64)
    offsets = offsets_from_lengths(torch.tensor([3, 40]))
    x = torch.randn(43, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="offsets is on meta"):
        fused(x, offsets.to("meta"))


@pytest.mark.parametrize("backend, qk_norm, cross", [("reference", False, True), ("reference", True, False),
                                                     ("portable", False, False),
                                                     ("portable", True, True)])
def test_fused_producers_match_the_plain_path(monkeypatch, backend, qk_norm, cross):
    """Same bf16 layer, the producers fused or not: the interpreter's GEMM may round y differently
    from torch's in rare elements, so a few MX values may differ; otherwise every step is the same.

    Gradient bar: typically the two differ by 1e-5 to 1e-4 (40 seeds on CPU, reference backend,
    causal with qk_norm), but one flipped e4m3 rounding in a query row that sees a single key (the
    first token of every causal sequence: its output is that key's V value, its dS only rounding
    noise) moved the k_proj gradient by 3.6e-2 (seed 2105884511: token 34's output by 2.3e-2); a
    producer bug moves them by O(1). The k_proj bias gets no gradient in exact arithmetic (softmax
    ignores a shift shared by every key), so both paths give rounding noise there (0.11 apart relative
    to it, seed 766536140): its difference is measured against the size its sum of per-key terms
    would have without that cancellation, which k_proj.weight's gradient gives per input feature."""
    fused, plain = _bf16_pair(dict(backend=backend, qk_norm=qk_norm), num_heads=4, num_kv_heads=2, head_dim=64,
                              kv_dim=48 if cross else None, causal=not cross, bias=cross)
    offsets = offsets_from_lengths(torch.tensor([0, 1, 33, 129, 31]))
    x = torch.randn(int(offsets[-1]), 96, dtype=torch.bfloat16, requires_grad=True)
    kwargs = {}
    if cross:
        offsets_kv = offsets_from_lengths(torch.tensor([5, 0, 40, 32, 127]))
        kwargs = dict(context=torch.randn(int(offsets_kv[-1]), 48, dtype=torch.bfloat16), offsets_kv=offsets_kv)
    calls = _calls_of(monkeypatch, "prequantized_attention_op")
    out, grads = _output_and_grads(fused, x, offsets, **kwargs)
    assert len(calls) == 1
    ref, ref_grads = _output_and_grads(plain, x, offsets, **kwargs)
    assert len(calls) == 1 and out.dtype == torch.bfloat16
    assert relative_l2(out, ref) < 1e-2
    names = ["x", *(name for name, _ in fused.named_parameters())]
    grads_by_name = dict(zip(names, ref_grads))
    for name, g, g_ref in zip(names, grads, ref_grads):
        assert g.dtype == g_ref.dtype, name
        if name == "k_proj.bias":
            weight = grads_by_name["k_proj.weight"].double()
            uncancelled = weight.norm() / weight.shape[1] ** 0.5
            assert float((g.double() - g_ref.double()).norm() / uncancelled) < 6e-2, name
        else:
            assert relative_l2(g, g_ref) < 6e-2, name


@pytest.mark.parametrize("backend", ["reference", "portable"])
def test_prequantized_attention_equals_quantizing_inside(backend):
    """Equal MXFP8 operands give bit-identical attention: Q and K quantized beforehand
    (``quantize_mxfp8``, what the producers emit bit for bit) or inside the attention."""
    from jagged_attn import fused_ops, ops
    from jagged_attn.quantize import quantize_mxfp8

    offsets_q = offsets_from_lengths(torch.tensor([1, 0, 33, 70]))
    offsets_k = offsets_from_lengths(torch.tensor([31, 5, 0, 129]))
    q = torch.randn(int(offsets_q[-1]), 4, 64, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(int(offsets_k[-1]), 2, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    q_mx, k_mx = quantize_mxfp8(q.detach(), offsets_q), quantize_mxfp8(k.detach(), offsets_k)
    common = (offsets_q, offsets_k, True, 0.1, backend, False)
    out, lse = fused_ops.prequantized_attention_op(q, k, v, q_mx.data, q_mx.scales, k_mx.data, k_mx.scales, *common)
    ref, ref_lse = ops.attention_op(q, k, v, *common, "sequence", False)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert all(torch.equal(g, g_ref) for g, g_ref in zip(grads, torch.autograd.grad(ref, (q, k, v), dout)))
    assert not lse.requires_grad


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_producer_ops_gradients_and_registration(device):
    """The producer ops' backward against autograd through plain torch, and opcheck (schema, fake
    implementations, autograd registration)."""
    from jagged_attn import fused_ops

    offsets = offsets_from_lengths(torch.tensor([3, 0, 40])).to(device)
    x = torch.randn(43, 48, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(2 * 64, 48, device=device, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(2 * 64, device=device, requires_grad=True)
    y, _, _, _ = fused_ops.linear_quantize_op(x, weight, bias, offsets, 2)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, weight, bias), dy)
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.bfloat16, torch.float32]
    y_ref = torch.nn.functional.linear(x.double(), weight.double(), bias.double()).unflatten(-1, (2, 64))
    for g, g_ref in zip(grads, torch.autograd.grad(y_ref, (x, weight, bias), dy.double())):
        assert relative_l2(g, g_ref) < 1e-2

    h = (torch.randn(43, 2, 64, device=device) * 3).requires_grad_(True)
    gain = (torch.randn(64, device=device) * 0.5 + 1).requires_grad_(True)
    normalized, _, _, _, _ = fused_ops.rms_norm_quantize_op(h, gain, offsets, 1e-6)
    ref = torch.nn.functional.rms_norm(h.double(), (64,), gain.double(), 1e-6)
    assert relative_l2(normalized, ref) < 1e-6
    dn = torch.randn_like(normalized)
    for g, g_ref in zip(torch.autograd.grad(normalized, (h, gain), dn),
                        torch.autograd.grad(ref, (h, gain), dn.double())):
        assert g.dtype == torch.float32 and relative_l2(g, g_ref) < 1e-5

    tests = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(torch.ops.jagged_attn.linear_quantize.default, (x, weight, bias, offsets, 2),
                          test_utils=tests)
    torch.library.opcheck(torch.ops.jagged_attn.rms_norm_quantize.default, (h, gain, offsets, 1e-6),
                          test_utils=tests)


def test_fused_layer_compiles_and_autocasts(monkeypatch):
    """The compiled fused layer (fake implementations, fullgraph) gives the eager result; fp32
    parameters under bf16 autocast take the fused path (the producers compute in bf16)."""
    offsets = offsets_from_lengths(torch.tensor([3, 40]))
    x = torch.randn(43, 64, requires_grad=True)
    calls = _calls_of(monkeypatch, "rms_norm_quantize_op")
    layer = JaggedAttention(64, num_heads=2, head_dim=64, causal=True, qk_norm=True, backend="reference",
                            fused_producers=True, center_kv=False, dtype=torch.bfloat16)
    out = layer(x.bfloat16(), offsets)
    assert len(calls) == 2
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x.bfloat16(), offsets), out)

    layer.float()
    calls.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x, offsets)
    assert len(calls) == 2 and out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in layer.parameters())
    assert x.grad.dtype == torch.float32


def test_fused_producers_auto_and_obstacles(monkeypatch):
    offsets = offsets_from_lengths(torch.tensor([3, 40]))
    x = torch.randn(43, 64, dtype=torch.bfloat16)
    calls = _calls_of(monkeypatch, "prequantized_attention_op")
    JaggedAttention(64, num_heads=2, head_dim=64, backend="portable", dtype=torch.bfloat16)(x, offsets)
    assert not calls  # auto fuses on CUDA only
    assert "fused_producers=None" in repr(JaggedAttention(64, num_heads=2))
    cases = [(dict(), "bfloat16"), (dict(head_dim=96, dtype=torch.bfloat16), "head dim"),
             (dict(dim=60, head_dim=64, dtype=torch.bfloat16), "multiples of 8")]
    for config, match in cases:
        layer = JaggedAttention(**{"dim": 64, **config}, num_heads=2, fused_producers=True, center_kv=False)
        with pytest.raises(ValueError, match=match):
            layer(torch.randn(43, layer.dim, dtype=layer.q_proj.weight.dtype), offsets)
    with pytest.raises(ValueError, match="backend must be one of"):
        JaggedAttention(64, num_heads=2, backend="cuda")
    with pytest.raises(ValueError, match="center_kv=False"):
        JaggedAttention(64, num_heads=2, head_dim=64, fused_producers=True, center_kv=True, dtype=torch.bfloat16)(
            x, offsets)
    layer = JaggedAttention(64, num_heads=2, head_dim=64, fused_producers=True, center_kv=False, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="offsets_kv"):
        layer(x, offsets, context=x[:40], offsets_kv=offsets)


GPU_LENGTHS = [0, 1, 31, 32, 33, 127, 128, 129, 700, 1000]


@pytest.mark.gpu
@pytest.mark.parametrize("backend, head_dim, qk_norm, cross", [("hopper-exact-scores", 128, False, False),
                                                               ("hopper-exact-scores", 64, True, True),
                                                               ("hopper", 128, True, False)])
def test_gpu_fused_layer_matches_the_plain_path(backend, head_dim, qk_norm, cross):
    """The fused layer's output and gradients against the same layer unfused and both against the
    fp64 twin with unquantized attention: the producers' GEMM rounds y in another order than
    cuBLAS, which moves a few MX values by one step, so the fused layer may differ from the plain
    one by about the quantization noise but must be as close to fp64 as the plain layer is."""
    device = "cuda"
    config = dict(num_heads=8, num_kv_heads=2, head_dim=head_dim, kv_dim=256 if cross else None, causal=not cross,
                  qk_norm=qk_norm, backend=backend, device=device)
    fused = JaggedAttention(512, **config, fused_producers=True, center_kv=False, dtype=torch.bfloat16)
    plain = JaggedAttention(512, **config, fused_producers=False, center_kv=False, dtype=torch.bfloat16)
    plain.load_state_dict(fused.state_dict())
    twin = JaggedAttention(512, **config, dtype=torch.float64)
    twin.load_state_dict({name: p.double() for name, p in fused.state_dict().items()})
    offsets = offsets_from_lengths(torch.tensor(GPU_LENGTHS)).to(device)
    x = torch.randn(int(offsets[-1]), 512, device=device, dtype=torch.bfloat16, requires_grad=True)
    x64 = x.detach().double().requires_grad_(True)
    kwargs, kwargs64 = {}, {}
    if cross:
        # Rolled, not reversed: 700 queries on one key would have zero true dQ, dK (the softmax over
        # one key is constant) and only quantization noise, whose relative size says nothing.
        offsets_kv = offsets_from_lengths(torch.tensor(GPU_LENGTHS[-1:] + GPU_LENGTHS[:-1])).to(device)
        context = torch.randn(int(offsets_kv[-1]), 256, device=device, dtype=torch.bfloat16)
        kwargs, kwargs64 = dict(context=context, offsets_kv=offsets_kv), dict(context=context.double(),
                                                                                offsets_kv=offsets_kv)
    out, grads = _output_and_grads(fused, x, offsets, **kwargs)
    ref, ref_grads = _output_and_grads(plain, x, offsets, **kwargs)
    out64 = _twin_output(twin, x64, offsets, **kwargs64)
    grads64 = torch.autograd.grad(out64.square().sum(), [x64, *twin.parameters()])
    names = ["out", "x", *(name for name, _ in fused.named_parameters())]
    for name, a, b, c in zip(names, (out, *grads), (ref, *ref_grads), (out64, *grads64)):
        fused_error, plain_error = relative_l2(a, c), relative_l2(b, c)
        print(f"[fused vs plain] {name}: {relative_l2(a, b):.2e}; vs fp64: fused {fused_error:.2e}, "
              f"plain {plain_error:.2e}")
        assert fused_error < 1.15 * plain_error + 2e-3, name
    assert relative_l2(out, ref) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["hopper-exact-scores", "hopper"])
def test_gpu_producer_mxfp8_gives_bit_identical_attention(backend):
    """The attention on the MXFP8 the producers emit equals the attention quantizing their bf16
    outputs itself (the producers' MXFP8 is ``quantize_mxfp8`` of their bf16 output): bit for bit
    with exact S; with FP8 S on the Gluon kernel (H200, 2026-11-30) O matched bit for bit but the
    LSE did not (cause not found yet), so that case is held to 1e-4."""
    from jagged_attn import fused_ops, ops

    device = "cuda"
    offsets_q = offsets_from_lengths(torch.tensor(GPU_LENGTHS)).to(device)
    offsets_k = offsets_from_lengths(torch.tensor(GPU_LENGTHS[::-1])).to(device)
    x = torch.randn(int(offsets_q[-1]), 256, device=device, dtype=torch.bfloat16)
    weight = torch.randn(8 * 128, 256, device=device, dtype=torch.bfloat16) / 16
    q, q_data, q_scales, _ = fused_ops.linear_quantize_op(x, weight, None, offsets_q, 8)
    pre_norm = torch.randn(int(offsets_k[-1]), 2, 128, device=device, dtype=torch.bfloat16)
    gain = torch.rand(128, device=device) + 0.5
    k, _, k_data, k_scales, _ = fused_ops.rms_norm_quantize_op(pre_norm, gain, offsets_k, 1e-6)
    v = torch.randn_like(k)
    common = (offsets_q, offsets_k, True, 128**-0.5, backend, False)
    out, lse = fused_ops.prequantized_attention_op(q, k, v, q_data, q_scales, k_data, k_scales, *common)
    ref, ref_lse = ops.attention_op(q, k, v, *common, "sequence", False)
    if backend != "hopper":
        assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    else:
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
        finite = torch.isfinite(lse)
        assert float((out.double() - ref.double()).norm() / ref.double().norm()) <= 1e-3
        assert float((lse[finite] - ref_lse[finite]).abs().amax()) <= 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("fused, checks, waits", [(True, True, 1), (False, True, 1), (True, False, 0)])
def test_gpu_layer_step_waits_for_the_device_once(fused, checks, waits):
    """A training step of the layer (its offsets seen before) copies from the device to the host once,
    fused producers or not: the check of q, k, v's finiteness (the offsets are known valid); never
    inside ``value_checks(False)``. Twelve waits per step made the fused layer 15% slower than the
    plain one on an H200 (docs/perf-history.md v15)."""
    layer = JaggedAttention(256, 4, head_dim=64, causal=True, backend="hopper-exact-scores", fused_producers=fused,
                            device="cuda", dtype=torch.bfloat16)
    offsets = offsets_from_lengths(torch.tensor(GPU_LENGTHS)).cuda()
    x = torch.randn(int(offsets[-1]), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        return torch.autograd.grad(layer(x, offsets).float().square().sum(), [x, *layer.parameters()])

    copies = device_to_host_copies(step, value_checks=checks)
    assert len(copies) == waits, copies


def test_the_layer_refuses_head_dims_its_backend_lacks():
    """Also on the fused path, which reaches the kernels without ``jagged_attention``'s checks."""
    layer = JaggedAttention(192, num_heads=2, head_dim=96, backend="portable", fused_producers=False)
    x = torch.randn(40, 192)
    with pytest.raises(ValueError, match=r"supports head_dim in \(64, 128\), got 96"):
        layer(x, torch.tensor([0, 15, 40]))
    assert JaggedAttention(192, num_heads=2, head_dim=96, backend="reference")(x, torch.tensor([0, 15, 40])).shape == (
        40, 192)
    fused = JaggedAttention(64, num_heads=2, head_dim=32, backend="portable", fused_producers=True,
                            center_kv=False, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"supports head_dim in \(64, 128\), got 32"):
        fused(torch.randn(40, 64, dtype=torch.bfloat16), torch.tensor([0, 15, 40]))
