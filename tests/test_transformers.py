"""jagged_attn.integrations.transformers on a tiny random Llama on CPU (reference backend): packed and padded
batches against SDPA per sequence, KV-cache generation, a few training steps."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from jagged_attn.integrations.transformers import register  # noqa: E402
from jagged_attn.metrics import relative_l2  # noqa: E402

# MXFP8 attention's logits against SDPA's (measured ~0.035 on this model); wrong masking (sequences seeing each
# other, padding attended) measured 0.8-1.2.
LOGITS_TOLERANCE = 0.1
LENGTHS = [5, 33, 1, 20]
VOCAB = 97


@pytest.fixture(scope="module")
def model():
    name = register()
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config).eval()
    model.set_attn_implementation(name)
    return model


def sdpa_logits(model, sequences, **kwargs):
    """Logits of each sequence alone, through SDPA (the model's attention is set back afterwards)."""
    attention = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            return [model(s[None], **kwargs).logits[0] for s in sequences]
    finally:
        model.set_attn_implementation(attention)


def random_sequences():
    return [torch.randint(0, VOCAB, (n,)) for n in LENGTHS]


def left_padded(sequences):
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(sequences):
        ids[row, width - len(s):], mask[row, width - len(s):] = s, 1
    return ids, mask


def test_register_names_attention_and_mask():
    assert register("jagged_test_name") == "jagged_test_name"
    assert "jagged_test_name" in transformers.AttentionInterface()
    assert "jagged_test_name" in transformers.masking_utils.AttentionMaskInterface()


@pytest.mark.parametrize("packing", ["position_ids", "cu_seq_lens"])
def test_packed_rows_match_sdpa_per_sequence(model, packing):
    sequences = random_sequences()
    offsets = torch.tensor([0] + LENGTHS).cumsum(0)
    kwargs = dict(position_ids=torch.cat([torch.arange(n) for n in LENGTHS])[None])
    if packing == "cu_seq_lens":
        kwargs.update(cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=max(LENGTHS),
                      max_length_k=max(LENGTHS))
    with torch.no_grad():
        packed = model(torch.cat(sequences)[None], **kwargs).logits[0]
    for got, ref in zip(packed.split(LENGTHS), sdpa_logits(model, sequences)):
        assert relative_l2(got, ref) < LOGITS_TOLERANCE


def test_padded_batch_matches_sdpa(model):
    """Left-padded rows with a 2-D mask, against SDPA on the same batch, at the real tokens."""
    ids, mask = left_padded(random_sequences())
    with torch.no_grad():
        ours = model(ids, attention_mask=mask).logits
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            ref = model(ids, attention_mask=mask).logits
    finally:
        model.set_attn_implementation("jagged_mxfp8")
    real = mask.bool()
    assert torch.isfinite(ours).all()
    for row in range(ids.shape[0]):
        assert relative_l2(ours[row][real[row]], ref[row][real[row]]) < LOGITS_TOLERANCE


def test_generate_with_kv_cache(model):
    """Greedy decoding of a left-padded batch through the KV cache: each step's logits as a forward pass
    over the whole generated batch gives them (SDPA, at the same positions)."""
    ids, mask = left_padded(random_sequences())
    new = 4
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, output_logits=True,
                                   return_dict_in_generate=True)
    steps = torch.stack(generated.logits, 1)
    assert generated.sequences.shape == (ids.shape[0], ids.shape[1] + new)
    full_mask = torch.cat([mask, torch.ones(ids.shape[0], new, dtype=mask.dtype)], 1)
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            ref = model(generated.sequences, attention_mask=full_mask).logits[:, ids.shape[1] - 1:-1]
    finally:
        model.set_attn_implementation("jagged_mxfp8")
    assert relative_l2(steps, ref) < LOGITS_TOLERANCE


def test_training_steps_lower_the_loss():
    """A fresh tiny Llama trained on packed rows for a few steps: gradients reach every parameter and the loss
    falls."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(config)
    model.set_attn_implementation(register())
    sequences = random_sequences()
    ids = torch.cat(sequences)[None]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    labels = ids.clone()
    labels[0, torch.tensor([0] + LENGTHS[:-1]).cumsum(0)] = -100  # no target across a sequence boundary
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(6):
        loss = model(ids, position_ids=positions, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        optimizer.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.gpu
def test_packed_rows_on_the_gpu_match_sdpa_and_train():
    """On CUDA in bf16 with the default backend (on Hopper its FP8 kernels; head_dim 64, which they
    support): packed rows against SDPA per sequence, and one training step with finite gradients."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    model.set_attn_implementation(register("jagged_mxfp8_gpu"))
    sequences = [s.cuda() for s in random_sequences()]
    ids = torch.cat(sequences)[None]
    positions = torch.cat([torch.arange(n, device="cuda") for n in LENGTHS])[None]
    refs = sdpa_logits(model, sequences)
    with torch.no_grad():
        packed = model(ids, position_ids=positions).logits[0]
    for got, ref in zip(packed.split(LENGTHS), refs):
        assert relative_l2(got.float(), ref.float()) < LOGITS_TOLERANCE
    model(ids, position_ids=positions, labels=ids).loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_unsupported_options_are_refused(model):
    query = torch.randn(1, 4, 3, 32)
    key = torch.randn(1, 2, 3, 32)
    from jagged_attn.integrations.transformers import attention_forward

    layer = model.model.layers[0].self_attn
    with pytest.raises(NotImplementedError, match="dropout=0.1.*sliding_window"):
        attention_forward(layer, query, key, key, None, dropout=0.1, sliding_window=16)
    with pytest.raises(ValueError, match="2-D padding mask"):
        attention_forward(layer, query, key, key, torch.ones(1, 1, 3, 3, dtype=torch.bool))
