"""`completion_logprobs` (teacher-forced log π(y_t | x, y_<t)) against naive computations, on the tiny presets:
left-padded prompts, right-padded completions, temperature, padding invariance, entropy bounds."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    RecurrentGemmaConfig,
    RecurrentGemmaForCausalLM,
)

import gspo.logprobs
from gspo.logprobs import (
    _backbone_and_head,
    _length_buckets,
    chunked_token_logprobs,
    completion_logprobs,
    default_chunk_tokens,
    default_vocab_chunk,
)
from gspo.models import build_preset

PAD = 0
TINY_LM = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
ATOL = 2e-5  # float32: a padded batch vs one row at a time differs in the last bits only


@pytest.fixture(scope="module", params=["tiny-dense", "tiny-moe"])
def model(request):
    model, _ = build_preset(request.param, seed=3)
    with torch.no_grad():  # sharper than the default init, so that distributions are far from uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    return model.eval()


def make_batch(vocab: int, seed: int = 0):
    """4 rows: prompts of lengths 5, 2, 7, 1 left-padded; completions of lengths 3, 6, 1, 4 right-padded."""
    g = torch.Generator().manual_seed(seed)
    p_lens, c_lens = [5, 2, 7, 1], [3, 6, 1, 4]
    s, t = max(p_lens), max(c_lens)
    prompt_ids = torch.full((4, s), PAD)
    prompt_mask = torch.zeros((4, s), dtype=torch.long)
    completion_ids = torch.full((4, t), PAD)
    completion_mask = torch.zeros((4, t), dtype=torch.long)
    for i, (lp, lc) in enumerate(zip(p_lens, c_lens, strict=True)):
        prompt_ids[i, s - lp:] = torch.randint(3, vocab, (lp,), generator=g)
        prompt_mask[i, s - lp:] = 1
        completion_ids[i, :lc] = torch.randint(1, vocab, (lc,), generator=g)
        completion_mask[i, :lc] = 1
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def naive_per_row(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=1.0):
    """Each row alone, without any padding: full forward, log_softmax over every position, gather."""
    out = torch.zeros(completion_ids.shape)
    for i in range(len(prompt_ids)):
        p = prompt_ids[i][prompt_mask[i].bool()]
        c = completion_ids[i][completion_mask[i].bool()]
        ids = torch.cat([p, c])[None]
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[0].float() / temperature
        logp = torch.log_softmax(logits, -1)[len(p) - 1:-1]  # position j predicts token j + 1
        out[i, :len(c)] = logp.gather(-1, c[:, None]).squeeze(-1)
    return out


def naive_padded(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=1.0):
    """The same padded batch, but logits of every position (no `logits_to_keep`)."""
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits.float()
    logp = torch.log_softmax(logits / temperature, -1)
    s = prompt_ids.shape[1]
    return logp[:, s - 1:-1].gather(-1, completion_ids[..., None]).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_matches_naive_full_logits(model, temperature):
    batch = make_batch(model.config.vocab_size)
    mask = batch[3].bool()
    with torch.no_grad():
        got, entropy = completion_logprobs(model, *batch, temperature=temperature)
    assert got.dtype == torch.float32 and got.shape == batch[2].shape
    assert entropy is None
    padded = naive_padded(model, *batch, temperature=temperature)
    per_row = naive_per_row(model, *batch, temperature=temperature)
    torch.testing.assert_close(got[mask], padded[mask], atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(got[mask], per_row[mask], atol=ATOL, rtol=1e-5)
    assert bool((got[mask] < 0).all())
    assert got[mask].std() > 0.1  # the check is not vacuous: log-probs vary a lot


def test_temperature_changes_the_distribution(model):
    batch = make_batch(model.config.vocab_size)
    mask = batch[3].bool()
    with torch.no_grad():
        a, _ = completion_logprobs(model, *batch, temperature=1.0)
        b, _ = completion_logprobs(model, *batch, temperature=0.5)
    assert (a[mask] - b[mask]).abs().max() > 1e-2


def test_padding_values_do_not_affect_real_positions(model):
    batch = make_batch(model.config.vocab_size)
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch
    g = torch.Generator().manual_seed(1)
    other_prompt = torch.where(prompt_mask.bool(), prompt_ids, torch.randint(3, 40, prompt_ids.shape, generator=g))
    other_compl = torch.where(completion_mask.bool(), completion_ids,
                              torch.randint(3, 40, completion_ids.shape, generator=g))
    assert not torch.equal(other_compl, completion_ids) and not torch.equal(other_prompt, prompt_ids)
    mask = completion_mask.bool()
    with torch.no_grad():
        a, _ = completion_logprobs(model, *batch)
        b, _ = completion_logprobs(model, other_prompt, prompt_mask, other_compl, completion_mask)
    torch.testing.assert_close(a[mask], b[mask], atol=1e-5, rtol=1e-5)


def test_a_row_does_not_depend_on_the_rest_of_the_batch(model):
    batch = make_batch(model.config.vocab_size)
    mask = batch[3].bool()
    with torch.no_grad():
        full, _ = completion_logprobs(model, *batch)
        for i in range(len(batch[0])):
            alone, _ = completion_logprobs(model, *(x[i:i + 1] for x in batch))
            torch.testing.assert_close(alone[0][mask[i]], full[i][mask[i]], atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_entropy_is_between_zero_and_log_vocab(model, temperature):
    batch = make_batch(model.config.vocab_size)
    mask = batch[3].bool()
    logprobs, entropy = completion_logprobs(model, *batch, temperature=temperature, with_entropy=True)
    assert entropy is not None and entropy.shape == logprobs.shape
    assert not entropy.requires_grad  # a diagnostic: no graph kept
    assert bool(torch.isfinite(entropy).all())
    assert bool((entropy[mask] >= 0).all())
    assert bool((entropy[mask] <= math.log(model.config.vocab_size) + 1e-4).all())
    # and it is the entropy of the temperature-scaled next-token distribution
    ids = torch.cat([batch[0], batch[2]], 1)
    attn = torch.cat([batch[1], batch[3]], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits
    logp = torch.log_softmax(logits[:, batch[0].shape[1] - 1:-1].float() / temperature, -1)
    expected = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(entropy[mask], expected[mask], atol=1e-4, rtol=1e-4)


def test_gradient_flows_to_the_weights_and_not_through_padding(model):
    """The loss on real tokens has a gradient; log-probs at padded positions are not part of it."""
    batch = make_batch(model.config.vocab_size)
    mask = batch[3].bool()
    model.zero_grad(set_to_none=True)
    logprobs, _ = completion_logprobs(model, *batch)
    assert logprobs.requires_grad
    logprobs[mask].sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
    model.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------- chunked head and padding-free forwards

GRAD_RTOL = 1e-5  # float32 gradients differ by summation order only: ≤ 1e-5 of each parameter's largest entry


def _logprobs_and_grads(model, batch, **kwargs):
    """Masked log-probs and the gradient of a fixed weighted sum of them, per parameter."""
    model.zero_grad(set_to_none=True)
    logprobs, entropy = completion_logprobs(model, *batch, **kwargs)
    mask = batch[3].bool()
    weights = torch.linspace(-1.0, 2.0, int(mask.sum()))
    (logprobs[mask] * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logprobs.detach()[mask], None if entropy is None else entropy[mask], grads


@pytest.mark.parametrize("options", [{"chunk_size": None}, {"chunk_size": 3}, {"chunk_size": 5, "trim_padding": True},
                                     {"chunk_size": None, "trim_padding": True}])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_and_trimmed_paths_equal_the_full_logits_path(model, options, temperature):
    """Values, entropy and every parameter's gradient equal the naive full-logits path (chunk_size=0)."""
    batch = make_batch(model.config.vocab_size, seed=4)
    want, want_entropy, want_grads = _logprobs_and_grads(model, batch, chunk_size=0, temperature=temperature,
                                                         with_entropy=True)
    got, entropy, grads = _logprobs_and_grads(model, batch, temperature=temperature, with_entropy=True, **options)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, atol=1e-4, rtol=1e-4)
    assert grads.keys() == want_grads.keys()
    for name, g in grads.items():
        scale = float(want_grads[name].abs().max())
        torch.testing.assert_close(g, want_grads[name], atol=GRAD_RTOL * scale, rtol=1e-4, msg=name)


def test_chunked_path_is_zero_at_padding_and_differentiable(model):
    batch = make_batch(model.config.vocab_size)
    logprobs, _ = completion_logprobs(model, *batch, chunk_size=2, trim_padding=True)
    assert logprobs.requires_grad
    assert bool((logprobs[~batch[3].bool()] == 0).all())


@pytest.mark.parametrize("vocab_chunk", [None, 7, 100])
def test_chunked_token_logprobs_matches_log_softmax_with_bias(vocab_chunk):
    """Chunks of tokens, whole rows of logits or slices of the vocabulary (7 words: 15 slices, the last of 3; 100:
    the last of 1): the log-probs, the entropy and every gradient of the full log-softmax."""
    g = torch.Generator().manual_seed(0)
    hidden = (0.5 * torch.randn(37, 16, generator=g)).requires_grad_()
    weight = torch.randn(101, 16, generator=g, requires_grad=True)
    bias = torch.randn(101, generator=g, requires_grad=True)
    targets = torch.randint(0, 101, (37,), generator=g)
    upstream = torch.randn(37, generator=g)
    grads = []
    for chunked in (False, True):
        if chunked:
            lp, ent = chunked_token_logprobs(hidden, weight, targets, bias, temperature=0.8, chunk_size=4,
                                             with_entropy=True, vocab_chunk=vocab_chunk)
        else:
            logp = torch.log_softmax((hidden @ weight.T + bias) / 0.8, -1)
            lp, ent = logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
        grads.append((lp.detach(), ent.detach(), *torch.autograd.grad((lp * upstream).sum(), [hidden, weight, bias])))
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_length_buckets_cover_every_row_once_and_bound_the_padding():
    g = torch.Generator().manual_seed(0)
    p_len = torch.randint(1, 20, (200,), generator=g).tolist()
    c_len = torch.randint(1, 600, (200,), generator=g).tolist()
    buckets = _length_buckets(p_len, c_len)
    assert sorted(i for b in buckets for i in b) == list(range(200))
    assert len(buckets) > 1  # ragged lengths are split
    padded = sum(len(b) * (max(p_len[i] for i in b) + max(c_len[i] for i in b)) for b in buckets)
    real = sum(p_len) + sum(c_len)
    assert padded <= real * 1.05 + 128 * len(buckets)
    assert len(_length_buckets([6] * 16, [16] * 16)) == 1  # equal lengths: one forward


SCALED_HEADS = {  # model classes whose logits are not head(last hidden state), each its own way
    "gemma2-softcap": lambda: Gemma2ForCausalLM(Gemma2Config(final_logit_softcapping=30.0, head_dim=16, **TINY_LM)),
    "recurrentgemma-softcap": lambda: RecurrentGemmaForCausalLM(RecurrentGemmaConfig(
        lru_width=32, block_types=["attention"], attention_window_size=16, **TINY_LM)),  # logits_soft_cap=30
    "cohere-scale": lambda: CohereForCausalLM(CohereConfig(logit_scale=0.0625, **TINY_LM)),
}


@pytest.mark.parametrize("name", sorted(SCALED_HEADS))
def test_models_with_scaled_logits_take_the_full_logits_path(model, name):
    """Whether logits are the head's is found by running the model's own forward on stood-in hidden states, not by a
    list of config keys: RecurrentGemma's `logits_soft_cap` was not on the list, and its π_θ came from uncapped logits
    (0.78 nats off) while the engine sampled the capped ones."""
    assert _backbone_and_head(model) is not None
    assert _backbone_and_head(torch.nn.Sequential()) is None  # no backbone / head split: not recognised
    torch.manual_seed(0)
    scaled = SCALED_HEADS[name]()
    assert _backbone_and_head(scaled) is None
    batch = make_batch(TINY_LM["vocab_size"], seed=1)
    want, _ = completion_logprobs(scaled, *batch, chunk_size=0)
    torch.testing.assert_close(completion_logprobs(scaled, *batch)[0], want)
    torch.testing.assert_close(completion_logprobs(scaled, *batch, trim_padding=True)[0] * batch[3], want * batch[3],
                               atol=1e-5, rtol=1e-5)


def test_prompt_sharing_equals_the_full_logits_path(model):
    """Rows with the same prompt (a group's completions) run it once and attend to its cached keys/values: values,
    entropy and gradients equal the full-logits path."""
    base = make_batch(model.config.vocab_size, seed=5)
    batch = tuple(torch.cat([x, x[:2], x[1:3], x[:1]]) for x in base)  # prompts 0, 1 and 2 repeated
    batch[2][4:] = torch.randint(3, model.config.vocab_size, batch[2][4:].shape) * batch[3][4:]  # new completions
    want, want_entropy, want_grads = _logprobs_and_grads(model, batch, chunk_size=0, with_entropy=True)
    got, entropy, grads = _logprobs_and_grads(model, batch, trim_padding=True, share_prompts=True, with_entropy=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, atol=1e-4, rtol=1e-4)
    for name, g in grads.items():
        scale = float(want_grads[name].abs().max())
        torch.testing.assert_close(g, want_grads[name], atol=GRAD_RTOL * scale, rtol=1e-4, msg=name)


def test_chunked_head_runs_in_float32_under_autocast():
    """trainer.mixed_precision: the backbone hands bf16 hidden states to a float32 head under autocast. The chunked
    log-softmax still runs in float32 (the upcast hidden states times the float32 weights), and its gradients come
    back in each input's own dtype."""
    g = torch.Generator().manual_seed(0)
    hidden = (0.5 * torch.randn(23, 16, generator=g)).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(67, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 67, (23,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = chunked_token_logprobs(hidden, weight, targets, chunk_size=5)
    grad_h, grad_w = torch.autograd.grad(lp.sum(), [hidden, weight])
    assert lp.dtype == torch.float32 and grad_h.dtype == torch.bfloat16 and grad_w.dtype == torch.float32
    upcast = hidden.detach().float().requires_grad_()
    want = torch.log_softmax(upcast @ weight.detach().T, -1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(lp, want, atol=2e-5, rtol=1e-5)  # fp32 logits: not bf16-rounded (errors ~1e-2)
    (want_h,) = torch.autograd.grad(want.sum(), [upcast])
    torch.testing.assert_close(grad_h.float(), want_h, atol=1e-2, rtol=1e-2)  # rounded to bf16 on the way out


def test_bf16_head_matmul_keeps_a_float32_log_softmax():
    """The mixed-precision head (what CUDA runs under autocast; forced here with head_dtype on a CPU): a bf16 matmul,
    then a float32 log-softmax. It is exactly that computation, its error against float32 is the tolerance stated in
    `chunked_token_logprobs` (measured 1.2e-2, mean 4.0e-3 at this seed), and much smaller than a bf16 log-softmax's
    (measured 3.7e-2, mean 1.5e-2)."""
    g = torch.Generator().manual_seed(0)
    m, h, v = 64, 256, 8192
    hidden = torch.randn(m, h, generator=g).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * (2.0 / h ** 0.5)).requires_grad_()  # logits of std 2
    targets = torch.randint(0, v, (m,), generator=g)
    upstream = torch.randn(m, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, entropy = chunked_token_logprobs(hidden, weight, targets, chunk_size=24, with_entropy=True,
                                             head_dtype=torch.bfloat16)
    grad_h, grad_w = torch.autograd.grad((lp * upstream).sum(), [hidden, weight])
    assert lp.dtype == entropy.dtype == grad_h.dtype == grad_w.dtype == torch.float32

    h32, w32 = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    logits = h32 @ w32.T
    assert 1.9 < float(logits.detach().std()) < 2.1
    logp = torch.log_softmax(logits, -1)
    want = logp.gather(-1, targets[:, None]).squeeze(-1)
    want_h, want_w = torch.autograd.grad((want * upstream).sum(), [h32, w32])
    bf16_logits = torch.nn.functional.linear(hidden.detach().bfloat16(), weight.detach().bfloat16())
    same = torch.log_softmax(bf16_logits.float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(lp.detach(), same, atol=1e-5, rtol=0)  # bf16 matmul, float32 log-softmax: exactly
    bf16_softmax = torch.log_softmax(bf16_logits, -1).gather(-1, targets[:, None]).squeeze(-1).float()

    err, bf16_err = (lp.detach() - want.detach()).abs(), (bf16_softmax - want.detach()).abs()
    assert float(err.mean()) > 1e-4  # bf16 really ran (a float32 head is within ~1e-6)
    assert float(err.max()) < 3e-2 and float(err.mean()) < 1e-2
    assert float(err.max()) < 0.5 * float(bf16_err.max()) and float(err.mean()) < 0.4 * float(bf16_err.mean())
    torch.testing.assert_close(entropy, -(logp.exp() * logp).sum(-1).detach(), atol=3e-2, rtol=0)
    for got, ref in ((grad_h, want_h), (grad_w, want_w)):
        assert float((got - ref).abs().max()) < 1.5e-2 * float(ref.abs().max())


def test_head_dtype_follows_autocast_only_on_the_listed_devices(model, monkeypatch):
    """head_dtype=None: the weights' dtype on a CPU even under autocast (test_chunked_head_runs_in_float32_under_
    autocast), the autocast dtype on HEAD_AUTOCAST_DEVICES (CUDA; here the CPU is listed to exercise it)."""
    batch = make_batch(model.config.vocab_size, seed=6)
    mask = batch[3].bool()

    def logprobs(**kwargs):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return completion_logprobs(model, *batch, **kwargs)[0][mask]

    fp32, bf16 = logprobs(head_dtype=torch.float32), logprobs(head_dtype=torch.bfloat16)
    assert torch.equal(logprobs(), fp32) and not torch.equal(bf16, fp32)
    monkeypatch.setattr(gspo.logprobs, "HEAD_AUTOCAST_DEVICES", frozenset({"cpu"}))
    assert torch.equal(logprobs(), bf16)
    with torch.no_grad():  # without autocast: the weights' dtype there too
        plain = completion_logprobs(model, *batch)[0][mask]
        assert torch.equal(plain, completion_logprobs(model, *batch, head_dtype=torch.float32)[0][mask])


def test_default_tiles_are_a_budget_of_float32_logits_per_device():
    """CPU: as many tokens as whole rows of logits fit 64 MiB; CUDA: 4,096 tokens over slices of 128 MiB."""
    assert default_chunk_tokens(151_936, "cpu") == (1 << 24) // 151_936 == 110  # 64 MiB, as before
    assert default_vocab_chunk(151_936, 110, "cpu") == 151_936  # whole rows
    assert default_chunk_tokens(52, "cpu") == (1 << 24) // 52 and default_vocab_chunk(52, (1 << 24) // 52, "cpu") == 52
    assert default_chunk_tokens(151_936, torch.device("cuda")) == 4096
    assert default_vocab_chunk(151_936, 4096, torch.device("cuda")) == (128 << 20) // (4 * 4096) == 8192
    assert default_vocab_chunk(5_000, 4096, "cuda") == 5_000  # a small vocabulary: whole rows
    assert default_chunk_tokens(10**9, "cpu") == 1 and default_vocab_chunk(10**9, 1, "cpu") == 1 << 24


def test_the_head_never_holds_a_second_copy_of_its_weight():
    """The mixed-precision head (a bf16 matmul over float32 weights, as CUDA runs it; forced on the CPU), over slices
    of the vocabulary: the forward holds no more than a few slices (no bf16 copy of the whole weight), the backward
    the float32 weight gradient and a few slices (no weight-sized bf16 product, nor its float32 sum). Measured with
    torch.profiler's memory events (allocations of the call only): 0.04× and 1.12× the weight's bytes; before
    slicing, 1.13× (a bf16 copy of the weight, and the chunk's logits) and 3.13× (the gradient, a bf16 copy of the
    weight, the bf16 product and, on the CPU, its float32 sum)."""
    from torch.profiler import ProfilerActivity, profile

    from test_memory_peak import memory_peak  # benchmarks/memory_peak.py, loaded there

    g = torch.Generator().manual_seed(0)
    m, h, v, width = 64, 256, 16_384, 1_024
    hidden = torch.randn(m, h, generator=g).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).requires_grad_()
    targets = torch.randint(0, v, (m,), generator=g)
    weight_bytes = weight.numel() * 4

    def peak(step) -> int:
        """The most bytes that `step` had allocated at once (frees of older memory left out)."""
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        return memory_peak.cpu_live_at_peak(memory_peak.profiled_allocations(prof))[0]

    out = {}
    forward = peak(lambda: out.update(lp=chunked_token_logprobs(hidden, weight, targets, chunk_size=m,
                                                                 head_dtype=torch.bfloat16, vocab_chunk=width)[0]))
    backward = peak(lambda: out["lp"].sum().backward())
    slice_bytes = m * width * 4 + width * h * 4  # a float32 tile of logits and a float32 slice of the weight
    assert forward < 0.25 * weight_bytes and forward < 8 * slice_bytes
    assert weight.grad is not None and weight_bytes <= backward < weight_bytes + 8 * slice_bytes


def test_ddp_policy_takes_the_chunked_head_inside_one_ddp_forward(model, tmp_path, monkeypatch):
    """Under DDP (`wrap_policy`), a training forward is one forward of the DDP module (whose reducer then all-reduces
    the gradients) and runs the chunked, trimmed path inside it: the LM head module never runs (no N×T×V logits), and
    values and gradients equal the bare model's."""
    import torch.distributed as dist

    from gspo.logprobs import LogprobForward
    from gspo.parallel import ProcessGroup, wrap_policy

    batch = make_batch(model.config.vocab_size, seed=5)
    want, _, want_grads = _logprobs_and_grads(model, batch, trim_padding=True, with_entropy=True)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        group = ProcessGroup(rank=0, world_size=1)
        monkeypatch.setattr(ProcessGroup, "enabled", property(lambda self: True))  # one process, wrapped as with two
        ddp = wrap_policy(group, model)
        assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel) and isinstance(ddp.module, LogprobForward)
        calls = {"ddp": 0, "head": 0}
        ddp.register_forward_pre_hook(lambda *_: calls.__setitem__("ddp", calls["ddp"] + 1))
        head = model.get_output_embeddings().register_forward_hook(
            lambda *_: calls.__setitem__("head", calls["head"] + 1))
        got, _, grads = _logprobs_and_grads(ddp, batch, trim_padding=True, with_entropy=True)
        head.remove()
    finally:
        dist.destroy_process_group()
    assert calls == {"ddp": 1, "head": 0}
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
    assert {n.removeprefix("module.module.") for n in grads} == set(want_grads)
    for name, g in grads.items():
        name = name.removeprefix("module.module.")
        torch.testing.assert_close(g, want_grads[name], atol=1e-6 * float(want_grads[name].abs().max()), rtol=1e-5)


def test_a_low_precision_product_is_accumulated_in_float32_without_rounding_it_first(device):
    """`_add_product` (the head's gradients over chunks and slices): acc += a @ b for bf16 a and b is the float32
    product of their values (on CUDA cuBLAS writes float32 directly; elsewhere the operands are upcast), not the
    product rounded to bf16 and then added (which is ~2^-9 of each entry off)."""
    from gspo.logprobs import _add_product

    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 256, generator=g).bfloat16().to(device)
    b = torch.randn(256, 48, generator=g).bfloat16().to(device)
    acc = torch.full((64, 48), 3.0, device=device)
    want = 3.0 + a.double() @ b.double()
    _add_product(acc, a, b)
    rounded = 3.0 + (a @ b).double()  # the bf16 product, then the sum
    assert acc.dtype == torch.float32
    assert float((acc.double() - want).abs().max()) < 1e-4 < float((rounded - want).abs().max())


@pytest.mark.parametrize("sizes", [{"chunk_size": -1}, {"vocab_chunk": -8}])
def test_a_negative_chunk_or_slice_is_refused(sizes):
    hidden, weight, targets = torch.randn(4, 8), torch.randn(16, 8), torch.randint(0, 16, (4,))
    with pytest.raises(ValueError, match="chunk_size and vocab_chunk are positive"):
        chunked_token_logprobs(hidden, weight, targets, **sizes)
