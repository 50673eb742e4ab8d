"""Properties of the built-in rollout engine `HFSampler` (and its sampling primitives).

Everything is built locally: a character tokenizer and tiny randomly initialised Qwen3 (dense) and Qwen3-MoE models.
The weights are initialised with a large std (0.1) so that distributions are far from uniform and rows end on EOS at
varied steps, which exercises the dropping of finished rows from the batch and the KV cache.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models
from transformers import (
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import gspo.rollout.sampler as sampler_module
from conftest import CPU_COMPILE_ROUNDS_AS_EAGER
from gspo.models import build_tokenizer as preset_tokenizer
from gspo.rollout import HFSampler, SamplingParams, filter_scores, policy_weights, row_seed, sample_from_logits
from gspo.rollout.assemble import Sample, assemble, encode_prompts, eos_ids
from gspo.trajectory import NO_VERSION, Trajectory

PAD, EOS = 0, 1
CHARS = "abcdefgh0123 .\n"
PROMPTS = ["abc", "h", "a b c d e f", "0 1 2 3 hhh"]
SEEDS = [11, 22, 33, 44]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; <pad>=0, <eos>=1, <unk>=2; left padding."""
    vocab = {"<pad>": PAD, "<eos>": EOS, "<unk>": 2}
    for c in CHARS:
        vocab[c] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


def build_model(kind: str, vocab_size: int, seed: int = 0) -> torch.nn.Module:
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=128,
        pad_token_id=PAD,
        eos_token_id=EOS,
        initializer_range=0.1,
    )
    torch.manual_seed(seed)
    if kind == "moe":
        config = Qwen3MoeConfig(moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, **common)
        return Qwen3MoeForCausalLM(config).eval()
    return Qwen3ForCausalLM(Qwen3Config(**common)).eval()


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="module")
def tiny(tok) -> dict[str, torch.nn.Module]:
    """Shared read-only models; tests that modify weights build their own."""
    return {kind: build_model(kind, len(tok)) for kind in ("moe", "dense")}


def teacher_forced_logprobs(model: torch.nn.Module, batch: Trajectory, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) at the sampled tokens from one cache-free forward over [prompt + completion]."""
    return log_softmax_at(teacher_forced_logits(model, batch) / temperature, batch.completion_ids)


def teacher_forced_logits(model: torch.nn.Module, batch: Trajectory) -> torch.Tensor:
    """float32 logits [N, T, V] predicting each completion token, same padding/mask/positions as the sampler."""
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
    positions = (mask.cumsum(1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    start = batch.prompt_ids.shape[1] - 1
    return logits[:, start : start + batch.completion_ids.shape[1]]


def log_softmax_at(scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(scores, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


def lengths(batch: Trajectory) -> list[int]:
    return batch.completion_mask.sum(1).tolist()


# ---------------------------------------------------------------------------------------------- 1. logprobs


@pytest.mark.parametrize("kind", ["moe", "dense"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_teacher_forced_forward_fp32(tok, tiny, kind, temperature):
    """fp32: cached decoding with row dropping reproduces a cache-free forward to atol 1e-5 (observed max ~2.5e-6).

    A misaligned KV-cache row after dropping finished rows would break this, so the batch must mix rows that end on
    EOS at different steps with truncated ones.
    """
    sampler = HFSampler(tiny[kind], tok, SamplingParams(temperature=temperature, max_new_tokens=24))
    batch = sampler.generate(PROMPTS, 4, SEEDS)
    assert batch.truncated.any() and not batch.truncated.all()
    assert len(set(lengths(batch))) > 3
    expected = teacher_forced_logprobs(tiny[kind], batch, temperature) * batch.completion_mask
    torch.testing.assert_close(batch.logprobs, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_logprobs_match_teacher_forced_forward_bf16(tok, tiny, kind):
    """bf16 engine for an fp32 model vs a cache-free forward of the engine's own bf16 weights.

    Dense: every token within atol 0.05 (observed max ~0.03). MoE: bf16 noise occasionally flips an expert choice,
    which moves single logprobs by up to ~0.4 (the rollout/training mismatch routing replay addresses), so we assert
    the mean absolute difference < 0.01 (observed ~0.004) and that fewer than 5% of tokens differ by more than 0.05.
    """
    sampler = HFSampler(tiny[kind], tok, SamplingParams(temperature=0.7, max_new_tokens=24), dtype=torch.bfloat16)
    assert next(sampler.model.parameters()).dtype == torch.bfloat16
    batch = sampler.generate(PROMPTS, 4, SEEDS)
    assert batch.logprobs.dtype == torch.float32
    expected = teacher_forced_logprobs(sampler.model, batch, 0.7) * batch.completion_mask
    diff = (batch.logprobs - expected).abs()[batch.completion_mask.bool()]
    if kind == "dense":
        assert diff.max() < 0.05
    else:
        assert diff.mean() < 0.01
        assert (diff > 0.05).float().mean() < 0.05


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_an_autocast_engine_samples_the_mixed_precision_policy(tok, tiny, kind):
    """`autocast="bfloat16"` (the trainer's mixed precision) on float32 weights: the engine shares the weights, its
    matmuls run in bf16, and its log-probs are those of the bf16-autocast policy the trainer computes π_old and π_θ
    with: closer to that than the float32 engine's (mean |Δ| observed 0.0035 vs 0.0074 dense, 0.0035 vs 0.0164
    MoE), still float32 tensors."""
    model = tiny[kind]
    seen: list[torch.dtype] = []
    hook = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    try:
        diffs = {}
        for autocast in (None, "bfloat16"):
            sampler = HFSampler(model, tok, SamplingParams(temperature=0.7, max_new_tokens=24), autocast=autocast)
            assert sampler.shares_weights and next(model.parameters()).dtype == torch.float32
            seen.clear()
            batch = sampler.generate(PROMPTS, 4, SEEDS)
            assert set(seen) == {torch.bfloat16 if autocast else torch.float32}
            assert batch.logprobs.dtype == torch.float32
            with torch.autocast("cpu", dtype=torch.bfloat16):  # the trainer's forward under mixed precision
                expected = teacher_forced_logprobs(model, batch, 0.7)
            diffs[autocast] = (batch.logprobs - expected).abs()[batch.completion_mask.bool()].mean()
    finally:
        hook.remove()
    assert diffs["bfloat16"] < 0.7 * diffs[None]
    # half weights already compute in their dtype: autocast is not applied to them
    assert HFSampler(model, tok, SamplingParams(), dtype="bfloat16", autocast="bfloat16").autocast is None


# ---------------------------------------------------------------------------------------------- 2. greedy


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_top_k_1_is_greedy_decoding(tok, tiny, kind):
    """top_k=1 keeps only the argmax: every row equals cache-free argmax decoding and every logprob is exactly 0."""
    model, max_new = tiny[kind], 12
    sampler = HFSampler(model, tok, SamplingParams(top_k=1, temperature=0.5, max_new_tokens=max_new))
    batch = sampler.generate(PROMPTS, 3, SEEDS)
    assert torch.all(batch.logprobs == 0)
    for g, prompt in enumerate(PROMPTS):
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        greedy = []
        with torch.no_grad():
            for _ in range(max_new):
                nxt = int(model(input_ids=torch.tensor([ids + greedy])).logits[0, -1].argmax())
                greedy.append(nxt)
                if nxt == EOS:
                    break
        for row in range(g * 3, g * 3 + 3):
            assert batch.completion_ids[row, : lengths(batch)[row]].tolist() == greedy


# ---------------------------------------------------------------------------------------------- 3. top-k / top-p


@pytest.mark.parametrize(("top_k", "top_p"), [(3, 1.0), (0, 0.6), (5, 0.8)])
def test_filtered_sampling_stays_in_kept_set_and_renormalises(tok, tiny, top_k, top_p):
    """Every sampled token lies in the top-k / nucleus set of the teacher-forced distribution, and its logprob is the
    renormalised one: log(p / p(kept set)) >= the unfiltered log p."""
    temperature = 0.9
    sampler = HFSampler(tiny["dense"], tok, SamplingParams(temperature, top_p, top_k, max_new_tokens=16))
    batch = sampler.generate(PROMPTS, 4, SEEDS)
    mask = batch.completion_mask.bool()
    scores = teacher_forced_logits(tiny["dense"], batch) / temperature
    probs = scores.softmax(-1)
    if top_k:
        probs = probs.masked_fill(probs < probs.topk(top_k, dim=-1).values[..., -1:], 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if top_p < 1:
        # token v is in the nucleus iff the mass of the strictly more probable tokens is below top_p
        above = (probs[..., None, :] * (probs[..., None, :] > probs[..., :, None])).sum(-1)
        probs = probs * (above < top_p)
    kept = probs > 0
    assert kept.gather(-1, batch.completion_ids[..., None]).squeeze(-1)[mask].all()
    tok_probs = probs.gather(-1, batch.completion_ids[..., None]).squeeze(-1)
    expected = (tok_probs / probs.sum(-1)).log()
    torch.testing.assert_close(batch.logprobs[mask], expected[mask], atol=1e-5, rtol=0)
    unfiltered = log_softmax_at(scores, batch.completion_ids)
    assert torch.all(batch.logprobs[mask] >= unfiltered[mask] - 1e-5)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 6),
    vocab=st.integers(2, 40),
    scale=st.floats(0.1, 8.0),
    temperature=st.floats(0.2, 2.0),
    top_k=st.integers(0, 10),
    top_p=st.floats(0.05, 1.0),
)
def test_sample_from_logits_properties(seed, rows, vocab, scale, temperature, top_k, top_p):
    """For random logits: tokens are kept by the filter, logprobs are the renormalised ones (never below the
    unfiltered ones), the nucleus is minimal, and top_k=1 is argmax."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * scale
    uniforms = torch.rand(rows, generator=gen)
    tokens, logprobs = sample_from_logits(logits, uniforms, temperature, top_k, top_p)
    scores = filter_scores(logits / temperature, top_k, top_p)
    kept = torch.isfinite(scores)
    assert kept.gather(1, tokens[:, None]).all()
    torch.testing.assert_close(logprobs, log_softmax_at(scores, tokens), atol=1e-6, rtol=0)
    assert torch.all(logprobs >= log_softmax_at(logits / temperature, tokens) - 1e-5)
    scores_k = filter_scores(logits / temperature, top_k, 1.0)
    probs_k = scores_k.softmax(-1)
    if top_k:  # count kept scores, not probabilities > 0: float32 softmax underflows for sharp logits
        assert torch.all(torch.isfinite(scores_k).sum(1) >= min(top_k, vocab))  # ties with the k-th may keep more
    kept_mass = (probs_k * kept).sum(1)
    smallest_kept = probs_k.masked_fill(~kept, float("inf")).min(1).values
    assert torch.all((kept_mass >= top_p - 1e-5) | (kept.sum(1) == vocab))
    assert torch.all((kept_mass - smallest_kept < top_p + 1e-5) | (kept.sum(1) == 1))
    greedy, greedy_lp = sample_from_logits(logits, uniforms, temperature, top_k=1)
    assert torch.equal(greedy, logits.argmax(1)) and torch.all(greedy_lp == 0)


def test_inverse_cdf_edges_pick_tokens_with_probability():
    """u = 0 and u just below 1 select the first and last tokens that the filter keeps, never a masked one."""
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0, -2.0]])
    for u, expected in [(0.0, 1), (1 - 2**-24, 3)]:
        token, logprob = sample_from_logits(logits, torch.tensor([u]), top_k=2)
        assert token.item() == expected and torch.isfinite(logprob).all()


def test_row_seed_is_distinct_per_row_and_non_negative():
    seeds = {row_seed(s, j) for s in (-5, 0, 1, 2**62) for j in range(64)}
    assert len(seeds) == 4 * 64 and all(0 <= s < 2**63 for s in seeds)


# ---------------------------------------------------------------------------------------------- 4. determinism


def test_same_seeds_give_identical_batches(tok, tiny):
    sampler = HFSampler(tiny["moe"], tok, SamplingParams(max_new_tokens=20))
    a, b = sampler.generate(PROMPTS, 4, SEEDS), sampler.generate(PROMPTS, 4, SEEDS)
    for field in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs", "truncated"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert a.completions == b.completions
    other = sampler.generate(PROMPTS, 4, [s + 1 for s in SEEDS])
    assert a.completions != other.completions
    # rows of one group use different random streams
    assert len(set(a.completions[:4])) > 1


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_group_does_not_depend_on_other_prompts(tok, tiny, kind):
    """A prompt's group is the same alone or in any batch/position (tokens exact, logprobs to 1e-5 in fp32)."""
    sampler = HFSampler(tiny[kind], tok, SamplingParams(max_new_tokens=20))
    together = sampler.generate(PROMPTS, 3, SEEDS)
    shuffled = sampler.generate(PROMPTS[::-1], 3, SEEDS[::-1])
    for g, (prompt, seed) in enumerate(zip(PROMPTS, SEEDS, strict=True)):
        alone = sampler.generate([prompt], 3, [seed])
        rows = slice(3 * g, 3 * g + 3)
        rows_shuffled = slice(3 * (len(PROMPTS) - 1 - g), 3 * (len(PROMPTS) - g))
        for other, sl in ((together, rows), (shuffled, rows_shuffled)):
            width = alone.completion_ids.shape[1]
            assert torch.equal(other.completion_mask[sl].sum(1), alone.completion_mask.sum(1))
            assert torch.equal(other.completion_ids[sl, :width], alone.completion_ids)
            torch.testing.assert_close(other.logprobs[sl, :width], alone.logprobs, atol=1e-5, rtol=0)
            assert other.completions[sl] == alone.completions
        assert torch.all(together.prompt_index[rows] == g)


# ---------------------------------------------------------------------------------------------- 5. stopping


def check_layout(batch: Trajectory, tok, max_new: int, eos_ids: set[int]) -> None:
    """Masks are 1 exactly on the first L tokens; EOS only ever as the last one; padding and text are consistent."""
    n = len(batch)
    assert batch.completion_ids.shape[1] == max(lengths(batch))
    n_prompts = int(batch.prompt_index.max()) + 1
    assert torch.equal(batch.prompt_index, torch.arange(n_prompts).repeat_interleave(n // n_prompts))
    for row in range(n):
        length = lengths(batch)[row]
        ids = batch.completion_ids[row].tolist()
        assert batch.completion_mask[row].tolist() == [1] * length + [0] * (len(ids) - length)
        assert all(i == PAD for i in ids[length:])
        assert torch.all(batch.logprobs[row, length:] == 0) and torch.all(batch.logprobs[row, :length] <= 0)
        assert not any(i in eos_ids for i in ids[: length - 1])
        ended_on_eos = ids[length - 1] in eos_ids
        if batch.truncated[row]:
            assert length == max_new and not ended_on_eos
        text_ids = ids[: length - 1] if ended_on_eos else ids[:length]
        assert batch.completions[row] == tok.decode(text_ids, skip_special_tokens=True)


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_eos_ends_rows_and_masks_include_it(tok, tiny, kind):
    max_new = 20
    batch = HFSampler(tiny[kind], tok, SamplingParams(max_new_tokens=max_new)).generate(PROMPTS, 4, SEEDS)
    check_layout(batch, tok, max_new, {EOS})
    # without stop strings, a row is truncated exactly when it does not end on EOS
    ended_on_eos = batch.completion_ids.gather(1, (batch.completion_mask.sum(1) - 1)[:, None]).squeeze(1) == EOS
    assert torch.equal(batch.truncated, ~ended_on_eos)
    assert batch.truncated.any() and ended_on_eos.any()
    assert batch.prompt_index.tolist() == [g for g in range(len(PROMPTS)) for _ in range(4)]
    assert batch.prompt_ids.shape == batch.prompt_mask.shape == (16, max(len(p) for p in PROMPTS))
    assert torch.all(batch.prompt_mask[:, -1] == 1)  # left padded


def test_generation_config_eos_ids_also_end_rows(tok):
    model = build_model("dense", len(tok))
    period = tok.convert_tokens_to_ids(".")
    model.generation_config.eos_token_id = [EOS, period]
    batch = HFSampler(model, tok, SamplingParams(max_new_tokens=20)).generate(PROMPTS, 4, SEEDS)
    check_layout(batch, tok, 20, {EOS, period})
    assert not any("." in c for c in batch.completions)


def test_stop_strings_cut_rows_right_after_the_first_occurrence(tok, tiny):
    """With stop strings, each row is the stop-free row (same seeds) cut at the first token whose decoded prefix
    contains a stop string; that row is not truncated and its text keeps the stop string."""
    max_new = 24
    free = HFSampler(tiny["dense"], tok, SamplingParams(max_new_tokens=max_new)).generate(PROMPTS, 4, SEEDS)
    # pick stop strings that occur somewhere (a two-character one and a one-character one)
    pairs = [c[i : i + 2] for c in free.completions for i in range(len(c) - 1) if " " not in c[i : i + 2]]
    stop = (max(set(pairs), key=pairs.count), "3")
    stopped = HFSampler(tiny["dense"], tok, SamplingParams(max_new_tokens=max_new, stop=stop)).generate(
        PROMPTS, 4, SEEDS
    )
    check_layout(stopped, tok, max_new, {EOS})
    n_cut = 0
    for row in range(len(free)):
        ids = free.completion_ids[row, : lengths(free)[row]].tolist()
        cut = next(
            (
                n
                for n in range(1, len(ids) + 1)
                if any(s in tok.decode(ids[:n], skip_special_tokens=True) for s in stop)
            ),
            None,
        )
        got = stopped.completion_ids[row, : lengths(stopped)[row]].tolist()
        if cut is None:
            assert got == ids and bool(stopped.truncated[row]) == bool(free.truncated[row])
        else:
            n_cut += 1
            assert got == ids[:cut] and not stopped.truncated[row]
            assert any(s in stopped.completions[row] for s in stop)
    assert n_cut >= 2


# ---------------------------------------------------------------------------------------------- 6. weights


def test_separate_dtype_engine_follows_update_weights(tok):
    trainer = build_model("moe", len(tok))
    trainer.train()
    sampler = HFSampler(trainer, tok, SamplingParams(max_new_tokens=16), dtype="bf16")
    assert sampler.model is not trainer and sampler.owns_weights
    assert all(p.dtype == torch.bfloat16 for p in sampler.model.parameters())
    rotary = dict(sampler.model.named_buffers())["model.rotary_emb.inv_freq"]
    assert rotary.dtype == torch.float32  # buffers keep their dtype
    before = sampler.generate(PROMPTS, 2, SEEDS)

    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    unchanged = sampler.generate(PROMPTS, 2, SEEDS)
    assert torch.equal(unchanged.completion_ids, before.completion_ids)  # the engine's copy is independent

    sampler.update_weights(policy_weights(trainer), version=1)
    after = sampler.generate(PROMPTS, 2, SEEDS)
    assert after.completions != before.completions
    assert (before.versions[before.loss_mask.bool()] == 0).all() and (after.versions[after.loss_mask.bool()] == 1).all()
    engine = dict(sampler.model.named_parameters())
    for name, p in trainer.named_parameters():
        assert torch.equal(engine[name], p.detach().to(torch.bfloat16)), name
    assert trainer.training and all(p.requires_grad for p in trainer.parameters())


def test_same_dtype_engine_shares_the_trainer_model(tok):
    trainer = build_model("dense", len(tok))
    sampler = HFSampler(trainer, tok, SamplingParams(max_new_tokens=16), dtype=torch.float32)
    assert sampler.model is trainer and not sampler.owns_weights
    before = sampler.generate(PROMPTS, 2, SEEDS)
    with torch.no_grad():
        trainer.lm_head.weight.mul_(3.0)
    after = sampler.generate(PROMPTS, 2, SEEDS)  # no update_weights needed
    assert after.completions != before.completions
    sampler.update_weights(iter(()), version=3)  # reads nothing: the weights are the trainer's own
    assert sampler.model is trainer and sampler.version == 3 and sampler.shares_weights


def test_update_weights_rejects_a_different_architecture(tok, tiny):
    sampler = HFSampler(tiny["dense"], tok, SamplingParams(), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="unexpected tensor"):
        sampler.update_weights(policy_weights(tiny["moe"]), 1)
    with pytest.raises(ValueError, match="missing"):
        sampler.update_weights(list(policy_weights(tiny["dense"]))[:-1], 1)


def test_generate_restores_train_mode_and_returns_normal_tensors(tok):
    model = build_model("dense", len(tok)).train()
    batch = HFSampler(model, tok, SamplingParams(max_new_tokens=8)).generate(PROMPTS[:2], 2, SEEDS[:2])
    assert model.training
    assert not batch.logprobs.is_inference() and not batch.completion_ids.is_inference()
    assert batch.logprobs.dtype == torch.float32 and batch.truncated.dtype == torch.bool
    assert batch.prompt_index.dtype == torch.long


# ---------------------------------------------------------------------------------------------- 7. validation


@pytest.mark.parametrize(
    ("prompts", "group_size", "seeds", "message"),
    [
        ([], 2, [], "prompts is empty"),
        (["ab"], 0, [1], "group_size must be >= 1"),
        (["ab", "cd"], 2, [1], "got 1 seeds for 2 prompts"),
        (["ab", ""], 2, [1, 2], "prompt 1 tokenizes to zero tokens"),
        (["ab", "a" * 120], 2, [1, 2], "prompt 1 has 120 tokens.*136 > max_position_embeddings=128"),
    ],
)
def test_generate_rejects_bad_requests(tok, tiny, prompts, group_size, seeds, message):
    sampler = HFSampler(tiny["dense"], tok, SamplingParams(max_new_tokens=16))
    with pytest.raises(ValueError, match=message):
        sampler.generate(prompts, group_size, seeds)


def test_generate_rejects_empty_stop_strings(tok, tiny):
    sampler = HFSampler(tiny["dense"], tok, SamplingParams(stop=("ab", "")))
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        sampler.generate(["ab"], 1, [0])


@pytest.mark.parametrize("dtype", ["int8", "notadtype", torch.int32])
def test_rejects_non_float_dtypes(tok, tiny, dtype):
    with pytest.raises(ValueError, match="floating-point"):
        HFSampler(tiny["dense"], tok, SamplingParams(), dtype=dtype)


def test_filter_rejects_bad_settings():
    with pytest.raises(ValueError):
        filter_scores(torch.zeros(1, 3), top_k=-1)
    with pytest.raises(ValueError):
        sample_from_logits(torch.zeros(1, 3), torch.zeros(1), temperature=0.0)


# ---------------------------------------------------------------------------------------------- 8. row dropping


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_dropping_finished_rows_does_not_change_results(tok, tiny, kind):
    params = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=24, stop=("3.",))
    dropping = HFSampler(tiny[kind], tok, params)
    keeping = HFSampler(tiny[kind], tok, params)
    keeping.drop_finished_rows = False
    a, b = dropping.generate(PROMPTS, 4, SEEDS), keeping.generate(PROMPTS, 4, SEEDS)
    assert len(set(lengths(a))) > 3  # rows really finished at different steps
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.truncated, b.truncated)
    assert a.completions == b.completions
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_a_row_cap_samples_in_batches_of_whole_groups_with_the_same_result(tok, tiny, kind, monkeypatch):
    """`max_rows` (rollout.max_batch_rows): 4 prompts × 4 rows under a cap of 13 rows run as batches of 3 and 1
    groups; the trajectory is the one batch's (same layout, tokens, prompt indices, R3 routing; log-probs to 1e-5)."""
    params = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=24, stop=("3.",))
    routing = kind == "moe"
    whole = HFSampler(tiny[kind], tok, params, record_routing=routing).generate(PROMPTS, 4, SEEDS)
    capped = HFSampler(tiny[kind], tok, params, record_routing=routing, max_rows=13)
    rows: list[int] = []
    decode = capped._decode
    monkeypatch.setattr(capped, "_decode", lambda ids, *a: rows.append(4 * len(ids)) or decode(ids, *a))
    parts = capped.generate(PROMPTS, 4, SEEDS)
    assert rows == [12, 4]
    assert_same_samples(whole, parts)
    for name in ("prompt_ids", "prompt_mask", "prompt_index", "versions"):
        assert torch.equal(getattr(whole, name), getattr(parts, name)), name
    if routing:
        assert torch.equal(whole.extras["routing"], parts.extras["routing"])


def test_ids_the_model_samples_past_the_tokenizer_are_accepted_back_as_a_prompt(tok):
    """Qwen's embedding has more rows than its tokenizer has words (151,936 vs 151,669) and the engine samples over
    all of them: a multi-turn episode feeds the reply's ids back as the next prompt, which was refused as 'not all
    ints in [0, len(tokenizer))' and stopped the run."""
    torch.manual_seed(0)
    model = build_model("dense", len(tok) + 48)  # untrained: the extra rows carry mass
    engine = HFSampler(model, tok, SamplingParams(max_new_tokens=8))
    first = engine.generate(["abc"], 8, [5])
    beyond = (first.completion_ids * first.completion_mask >= len(tok)).any(-1)
    assert beyond.any()  # so the test can fail
    i = int(beyond.nonzero()[0])
    reply = first.completion_ids[i, :int(first.completion_mask[i].sum())].tolist()
    again = engine.generate([tok("abc", add_special_tokens=False)["input_ids"] + reply], 2, [0])
    assert len(again) == 2
    with pytest.raises(ValueError, match=rf"not all are ints in \[0, {len(tok) + 48}\)"):  # the model's rows
        engine.generate([[len(tok) + 48]], 1, [0])


def test_a_group_larger_than_the_row_cap_runs_whole(tok, tiny, monkeypatch):
    """A library caller's group above `max_rows` cannot be split: it runs whole, alone (it recursed until a
    RecursionError)."""
    params = SamplingParams(max_new_tokens=6)
    capped = HFSampler(tiny["dense"], tok, params, max_rows=3)
    rows: list[int] = []
    decode = capped._decode
    monkeypatch.setattr(capped, "_decode", lambda ids, *a: rows.append(4 * len(ids)) or decode(ids, *a))
    traj = capped.generate(PROMPTS[:2], 4, SEEDS[:2])
    assert rows == [4, 4] and len(traj) == 8
    assert_same_samples(HFSampler(tiny["dense"], tok, params).generate(PROMPTS[:2], 4, SEEDS[:2]), traj)


# ---------------------------------------------------------------------------------------------- 9. static KV cache


def assert_same_samples(a: Trajectory, b: Trajectory) -> None:
    """The same tokens, ends and texts, and log-probs equal within float tolerance (attention over padded slots)."""
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.truncated, b.truncated)
    assert torch.equal(a.completion_mask, b.completion_mask) and a.completions == b.completions
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["moe", "dense"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=24, stop=("3.",)),
    SamplingParams(temperature=1.0, top_k=1, max_new_tokens=40),  # greedy (evaluation)
], ids=["sampled-stop", "greedy"])
def test_static_cache_decode_matches_the_dynamic_one(tok, tiny, kind, params):
    """The fixed-shape loop (the one a compiled step runs) samples what the growing-cache loop samples: same rows,
    ends (EOS, stop strings, truncation) and texts, for a mixed-length batch, twice (a fresh cache per call)."""
    dynamic = HFSampler(tiny[kind], tok, params)
    static = HFSampler(tiny[kind], tok, params, decode="static")
    a = dynamic.generate(PROMPTS, 4, SEEDS)
    assert len(set(lengths(a))) > 2 or not params.stop  # sampled: rows really finished at different steps
    assert_same_samples(a, static.generate(PROMPTS, 4, SEEDS))
    assert_same_samples(dynamic.generate(PROMPTS[::-1], 3, SEEDS), static.generate(PROMPTS[::-1], 3, SEEDS))


def test_static_cache_logprobs_match_the_teacher_forced_forward(tok, tiny):
    engine = HFSampler(tiny["dense"], tok, SamplingParams(temperature=0.7, max_new_tokens=16), decode="static")
    batch = engine.generate(PROMPTS, 2, SEEDS)
    expected = teacher_forced_logprobs(tiny["dense"], batch, 0.7)
    torch.testing.assert_close(batch.logprobs * batch.completion_mask, expected * batch.completion_mask,
                               atol=1e-5, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled (CUDA graphs) decode step needs a GPU")
def test_compiled_decode_on_cuda_matches_the_dynamic_loop(tok):
    """auto picks the compiled loop on CUDA; its samples equal the eager growing-cache loop's, call after call."""
    model = build_model("dense", len(tok)).cuda()
    params = SamplingParams(temperature=0.9, max_new_tokens=24)
    compiled = HFSampler(model, tok, params, decode="auto")
    assert compiled.decode == "compiled"
    dynamic = HFSampler(model, tok, params, decode="dynamic")
    for seeds in (SEEDS, [5, 6, 7, 8], SEEDS):
        assert_same_samples(dynamic.generate(PROMPTS, 4, seeds), compiled.generate(PROMPTS, 4, seeds))


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=[pytest.mark.slow,  # inductor's C++ compile: ~35 s on a 2-core CPU
                               pytest.mark.skipif(not CPU_COMPILE_ROUNDS_AS_EAGER, reason="torch < 2.13 on the CPU")]),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")),
])
def test_compiled_decode_under_autocast_samples_what_the_eager_loop_samples(tok, device):
    """The sampler of `trainer.mixed_precision: bfloat16` (bf16 autocast over float32 weights, as TRL's generation)
    with the compiled decode loop: bf16 static caches (`NarrowStaticCache`), grouped decode attention, bf16 copies of
    the Linear weights (`autocast_twin`), inductor with eager's roundings (`gspo.models.COMPILE_OPTIONS`), CUDA
    graphs on CUDA. It samples what the eager static loop samples under the same autocast: on the CPU bit for bit
    (without those options 2 of these 16 rows differed and log-probs by up to 0.02); on CUDA, whose fused reductions
    may sum in another order than eager's kernels, the same tokens in at least 14 of 16 rows and log-probs within
    0.01 where they agree."""
    model = build_model("dense", len(tok)).to(device)
    params = SamplingParams(temperature=0.9, max_new_tokens=24)
    compiled = HFSampler(model, tok, params, decode="compiled", autocast="bfloat16")
    eager = HFSampler(model, tok, params, decode="static", autocast="bfloat16")
    assert compiled.grouped_decode  # 4 query heads share 2 KV heads
    for seeds in (SEEDS, [5, 6, 7, 8]):
        a, b = compiled.generate(PROMPTS, 4, seeds), eager.generate(PROMPTS, 4, seeds)
        if device == "cpu":
            assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
        else:
            same = (a.completion_ids == b.completion_ids).all(1)
            assert int(same.sum()) >= 14, f"{int((~same).sum())} of 16 rows sampled other tokens"
            torch.testing.assert_close(a.logprobs[same], b.logprobs[same], atol=1e-2, rtol=0)
    (cache,) = compiled._static_caches.values()
    assert {(layer.keys.dtype, layer.values.dtype) for layer in cache.layers} == {(torch.bfloat16,) * 2}
    assert compiled._twin_pairs  # the compiled step ran on bf16 copies of the Linear weights (autocast_twin)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA graphs of the compiled decode step need a GPU")
def test_a_released_cache_on_cuda_keeps_its_addresses_and_its_graphs_samples(tok):
    """rollout.release_decode_cache on CUDA: `release` unmaps the caches (torch_memory_saver) and the next call maps
    them again at the same addresses, so the recorded CUDA graphs replay as they are: the same samples as the eager
    growing-cache loop, call after call, the same cache tensors at the same addresses, and (run alone, not under
    pytest-xdist, whose other processes move the device's free memory) at least the caches' bytes given back."""
    import importlib.util
    import os

    from gspo.rollout import cache_memory

    if importlib.util.find_spec("torch_memory_saver") is None:
        pytest.skip("torch_memory_saver is not installed")
    model = build_model("dense", len(tok)).cuda()
    params = SamplingParams(temperature=0.9, max_new_tokens=24)
    engine = HFSampler(model, tok, params, decode="compiled", release_cache=True)
    dynamic = HFSampler(model, tok, params, decode="dynamic")
    prompts, seeds = PROMPTS * 16, list(range(64))  # 256 rows: caches of 4 MB per layer's K or V
    assert_same_samples(dynamic.generate(prompts, 4, seeds), engine.generate(prompts, 4, seeds))
    (cache,) = engine._static_caches.values()
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    addresses = [t.data_ptr() for t in tensors]
    size = sum(t.untyped_storage().nbytes() for t in tensors)
    for round_seeds in (seeds[::-1], seeds):
        torch.cuda.synchronize()
        free = torch.cuda.mem_get_info()[0]
        engine.release()
        assert cache_memory.paused()
        if os.environ.get("PYTEST_XDIST_WORKER") is None:
            assert torch.cuda.mem_get_info()[0] - free >= size
        assert_same_samples(dynamic.generate(prompts, 4, round_seeds), engine.generate(prompts, 4, round_seeds))
        assert not cache_memory.paused()
        assert list(engine._static_caches.values()) == [cache]
        assert [t.data_ptr() for t in tensors] == addresses


def test_compiled_mode_reuses_its_cache_and_keeps_its_weights(tok, tiny, monkeypatch):
    """The compiled loop's fixed addresses: one KV cache per shape, reset between calls (results as a fresh cache
    gives), and an own copy's weights stay allocated through release(). The compile itself is replaced by the eager
    step here (it takes a minute on this CPU; the CUDA test and the slow test run it)."""
    monkeypatch.setattr(sampler_module, "compile_decode_step", lambda model, cuda: model)
    params = SamplingParams(temperature=0.8, max_new_tokens=12)
    engine = HFSampler(tiny["moe"], tok, params, dtype="bf16", decode="compiled")
    reference = HFSampler(tiny["moe"], tok, params, dtype="bf16", decode="static")
    first = engine.generate(PROMPTS, 4, SEEDS)
    (cache,) = engine._static_caches.values()
    engine.release()
    assert all(p.numel() > 0 for p in engine.model.parameters())
    for seeds in ([9, 8, 7, 6], SEEDS):
        assert_same_samples(reference.generate(PROMPTS, 4, seeds), engine.generate(PROMPTS, 4, seeds))
    assert list(engine._static_caches.values()) == [cache]
    assert_same_samples(first, engine.generate(PROMPTS, 4, SEEDS))


@pytest.mark.parametrize(("dtype", "autocast"), [("bf16", None), (None, "bfloat16")], ids=["bf16-copy", "autocast"])
def test_compiled_mode_releases_its_caches_when_asked(tok, tiny, monkeypatch, dtype, autocast):
    """`release_cache` (rollout.release_decode_cache): `release` gives the caches' memory back (here on the CPU, by
    freeing them; on CUDA by unmapping them at the same addresses, test_cache_memory), an own copy's weights stay, and
    the next calls sample what a fresh static cache samples. A cache made ahead of the prefill (`_allocate`) holds
    K and V in bf16 under bf16 autocast too (the model computes K in float32 there:
    test_a_static_cache_under_autocast_holds_bf16_keys_and_samples_the_same)."""
    import gc
    import weakref

    monkeypatch.setattr(sampler_module, "compile_decode_step", lambda model, cuda: model)
    params = SamplingParams(temperature=0.8, max_new_tokens=12)
    engine = HFSampler(tiny["dense"], tok, params, dtype=dtype, decode="compiled", autocast=autocast,
                       release_cache=True)
    reference = HFSampler(tiny["dense"], tok, params, dtype=dtype, decode="static", autocast=autocast)
    first = engine.generate(PROMPTS, 4, SEEDS)
    assert_same_samples(reference.generate(PROMPTS, 4, SEEDS), first)
    (cache,) = engine._static_caches.values()
    layer = cache.layers[0]
    assert (layer.keys.dtype, layer.values.dtype) == (torch.bfloat16, torch.bfloat16)
    freed = weakref.ref(layer.keys)
    del cache, layer
    engine.release()
    gc.collect()
    assert engine._static_caches == {} and freed() is None
    assert all(p.numel() > 0 for p in engine.model.parameters())
    for seeds in ([9, 8, 7, 6], SEEDS):
        assert_same_samples(reference.generate(PROMPTS, 4, seeds), engine.generate(PROMPTS, 4, seeds))
    assert_same_samples(first, engine.generate(PROMPTS, 4, SEEDS))


def test_an_autocast_twin_holds_its_linear_weights_in_bf16_and_shares_every_other_tensor(tok):
    """`autocast_twin`, the module the compiled decode step runs under bf16 autocast over float32 weights: every
    nn.Linear's weight and bias is a bf16 copy of the model's (one copy for a weight two layers share), every other
    parameter, buffer and the config are the model's own objects (no second float32 copy: the twin costs 2 bytes per
    Linear parameter), a tied embedding stays the float32 tensor the model's head shares (the model's own tie is
    untouched), and under autocast the twin computes the model's logits bit for bit. `refresh_twin`
    follows the model's weights in place."""
    from gspo.rollout.sampler import autocast_twin, refresh_twin

    config = Qwen3Config(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=128,
                         pad_token_id=PAD, eos_token_id=EOS, tie_word_embeddings=True, attention_bias=True)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    twin, pairs = autocast_twin(model, torch.bfloat16)
    refresh_twin(pairs)
    linear = {name for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    ours = dict(model.named_parameters(remove_duplicate=False))
    theirs = dict(twin.named_parameters(remove_duplicate=False))
    assert ours.keys() == theirs.keys()
    for name, p in theirs.items():
        if name.rsplit(".", 1)[0] in linear:
            assert p.dtype == torch.bfloat16 and p is not ours[name] and not p.requires_grad
            assert torch.equal(p, ours[name].detach().to(torch.bfloat16)), name
        else:
            assert p is ours[name], name
    assert all(a is b for a, b in zip(model.buffers(), twin.buffers(), strict=True)) and twin.config is model.config
    assert any(".bias" in name for name in theirs if name.rsplit(".", 1)[0] in linear)
    assert twin.model.embed_tokens.weight is model.model.embed_tokens.weight  # float32, for the embedding lookup
    assert twin.lm_head.weight.dtype == torch.bfloat16 and model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(c.numel() for c, _ in pairs) == sum(p.numel() for p in {id(p): p for n, p in ours.items()
                                                                      if n.rsplit(".", 1)[0] in linear}.values())
    assert not twin.training
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(twin(input_ids=ids).logits, model(input_ids=ids).logits)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(-1)
        model.lm_head.weight.add_(1.0)
    refresh_twin(pairs)
    for name in ("model.layers.0.mlp.up_proj.weight", "lm_head.weight"):
        assert torch.equal(theirs[name], ours[name].detach().to(torch.bfloat16)), name


def test_compiled_mode_under_autocast_samples_the_weights_of_the_moment(tok, monkeypatch):
    """The compiled step runs the twin's bf16 copies of the weights, so they must follow the weights the engine is
    given: between calls (`update_weights`) and within one (a partial rollout's `between_tokens` bringing a new
    version). An own-copy float32 engine under bf16 autocast (an asynchronous worker's) samples, call after call, what
    the eager static loop samples with the same weights at the same steps (each call's start and a mid-generation
    switch at the 4th token), and the new weights do sample other tokens. (The compile is replaced by the eager
    step, as above.)"""
    monkeypatch.setattr(sampler_module, "compile_decode_step", lambda model, cuda: model)
    model = build_model("dense", len(tok))
    old = {k: v.clone() for k, v in model.state_dict().items()}
    noise = torch.Generator().manual_seed(5)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=noise) for k, v in old.items()}
    params = SamplingParams(temperature=0.8, max_new_tokens=12)

    def run(decode: str) -> tuple[HFSampler, list[Trajectory]]:
        engine = HFSampler(model, tok, params, own_copy=True, decode=decode, autocast="bfloat16")
        batches = [engine.generate(PROMPTS, 4, SEEDS)]
        engine.update_weights(new.items(), 1)
        batches.append(engine.generate(PROMPTS, 4, SEEDS))
        engine.update_weights(old.items(), 2)
        calls = []

        def between_tokens() -> None:
            calls.append(None)
            if len(calls) == 3:  # after the 4th token was sampled
                engine.update_weights(new.items(), 3)

        engine.between_tokens = between_tokens
        batches.append(engine.generate(PROMPTS, 4, SEEDS))
        return engine, batches

    compiled, got = run("compiled")
    _, want = run("static")
    assert compiled._twin_pairs  # the step ran the twin
    for a, b in zip(want, got, strict=True):
        assert_same_samples(a, b)
    assert not torch.equal(got[0].completion_ids, got[1].completion_ids)
    assert not torch.equal(got[0].completion_ids, got[2].completion_ids)
    assert set(got[2].versions[got[2].completion_mask.bool()].tolist()) == {2, 3}


def test_static_caches_are_laid_out_as_the_model_computes_k_and_v(tok, tiny, monkeypatch):
    """Before transformers 5.24 a StaticCache layer allocated V in K's dtype (float32 under bf16 autocast over
    float32 weights, whose rotary embedding leaves K in float32), and then refused the bf16 V ("index_copy_(): self
    and source expected to have the same dtype"): the engine's layout probe ran through such a cache, so every
    static and compiled decode under autocast failed there (the GPU machine has transformers 5.17). The probe now
    records what each layer hands its cache: with that allocation restored, both loops sample what they sample
    without it."""
    from transformers.cache_utils import StaticLayer

    params = SamplingParams(temperature=0.8, max_new_tokens=12)
    monkeypatch.setattr(sampler_module, "compile_decode_step", lambda model, cuda: model)
    want = {decode: HFSampler(tiny["dense"], tok, params, decode=decode, autocast="bfloat16").generate(PROMPTS, 4,
                                                                                                        SEEDS)
            for decode in ("static", "compiled")}
    allocate = StaticLayer.lazy_initialization

    def values_in_the_keys_dtype(self, key_states, value_states, *args, **kwargs):  # transformers < 5.24
        return allocate(self, key_states, value_states.to(key_states.dtype), *args, **kwargs)

    monkeypatch.setattr(StaticLayer, "lazy_initialization", values_in_the_keys_dtype)
    for decode, batch in want.items():
        engine = HFSampler(tiny["dense"], tok, params, decode=decode, autocast="bfloat16")
        assert {t.dtype for kv in engine._cache_layout() for t in kv} == {torch.bfloat16}
        assert_same_samples(batch, engine.generate(PROMPTS, 4, SEEDS))


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_static_cache_under_autocast_holds_bf16_keys_and_samples_the_same(tok, tiny, kind):
    """Under bf16 autocast over float32 weights the rotary embedding leaves K in float32, and a static cache allocated
    as transformers does (on the first update) holds it so: 1.5× the bf16 cache (transformers 5.24; before, V too,
    and the bf16 V was then refused). Every op reading K casts it to bf16 first, so `NarrowStaticCache` stores it in
    bf16: the same samples and log-probs, bit for bit, as the same loop over a float32 cache."""
    from transformers import DynamicCache

    from gspo.rollout.sampler import NarrowStaticCache

    params = SamplingParams(temperature=0.8, max_new_tokens=20)
    static = HFSampler(tiny[kind], tok, params, decode="static", autocast="bfloat16")
    wide_keys = HFSampler(tiny[kind], tok, params, decode="static", autocast="bfloat16")
    wide_keys._layout = [tuple(t.float() for t in kv) for kv in static._cache_layout()]  # float32 K and V
    caches = []
    update = NarrowStaticCache.update

    def spy(self, *args, **kwargs):
        caches.append(self)
        return update(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(NarrowStaticCache, "update", spy)
        narrow = static.generate(PROMPTS, 4, SEEDS)
    assert {(layer.keys.dtype, layer.values.dtype) for layer in caches[0].layers} == {(torch.bfloat16,) * 2}
    wide = DynamicCache(config=tiny[kind].config)  # what the growing loop holds: float32 keys
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        tiny[kind](input_ids=narrow.prompt_ids[:1], use_cache=True, past_key_values=wide)
    assert wide.layers[0].keys.dtype == torch.float32
    reference = wide_keys.generate(PROMPTS, 4, SEEDS)
    assert torch.equal(reference.completion_ids, narrow.completion_ids)
    assert torch.equal(reference.logprobs, narrow.logprobs)


def test_a_cache_release_on_cuda_needs_torch_memory_saver(monkeypatch):
    """On CUDA the compiled loop's caches are unmapped, not freed (its CUDA graphs replay their addresses): without
    torch_memory_saver that is refused with what to install, and so are the allocator's expandable segments, which
    torch_memory_saver refuses at its first use; other loops and devices need nothing."""
    import importlib.util

    from gspo.rollout.cache_memory import check_release

    for decode, device in (("compiled", "cpu"), ("dynamic", "cuda"), ("static", "cuda")):
        check_release(decode, device)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512,expandable_segments:True")
    with pytest.raises(ValueError, match=r"refuses to run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"):
        check_release("compiled", "cuda")
    check_release("compiled", "cpu")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    if importlib.util.find_spec("torch_memory_saver") is not None:
        check_release("compiled", "cuda")
        return
    with pytest.raises(ValueError, match=r"rollout.release_decode_cache: .*pip install torch_memory_saver"):
        check_release("compiled", "cuda")


def test_compiled_mode_keeps_a_bounded_number_of_caches(tok, tiny, monkeypatch):
    """One cache per (rows, length) was kept for the engine's life: multi-turn episodes, whose active rows and context
    change every turn, accumulated caches until the GPU ran out of memory. At most KEPT_CACHES stay, least recently
    used freed first, and the samples are still those of a fresh cache."""
    from gspo.rollout.sampler import KEPT_CACHES

    monkeypatch.setattr(sampler_module, "compile_decode_step", lambda model, cuda: model)
    params = SamplingParams(temperature=0.8, max_new_tokens=6)
    engine = HFSampler(tiny["moe"], tok, params, decode="compiled")
    reference = HFSampler(tiny["moe"], tok, params, decode="static")
    for n in range(1, len(PROMPTS) + 1):
        for group in (1, 2):
            assert_same_samples(reference.generate(PROMPTS[:n], group, SEEDS[:n]),
                                engine.generate(PROMPTS[:n], group, SEEDS[:n]))
            assert len(engine._static_caches) <= KEPT_CACHES
    assert len({rows for rows, _ in engine._static_caches}) == KEPT_CACHES  # the latest shapes are the ones kept
    assert next(reversed(engine._static_caches))[0] == 2 * len(PROMPTS)


def test_compiled_mode_keeps_its_caches_within_a_share_of_the_devices_memory(tok, tiny, monkeypatch):
    """KEPT_CACHE_SHARE: the kept caches hold together at most that share of the device's memory (here a budget of
    2.5 times a 4-row cache): a shape that would pass it frees the least recently used first, and a call whose cache
    would be over the budget alone decodes with the dynamic loop, leaving the kept caches be. A cache's bytes are what
    its layout predicts (bf16 K and V under autocast), and the samples are those of a fresh cache throughout."""
    from gspo.rollout.sampler import cache_bytes

    def allocated(cache) -> int:  # what its K and V tensors hold
        return sum(t.nbytes for layer in cache.layers if layer.is_initialized for t in (layer.keys, layer.values))

    monkeypatch.setattr(sampler_module, "compile_decode_step", lambda model, cuda: model)
    params = SamplingParams(temperature=0.8, max_new_tokens=6)
    engine = HFSampler(tiny["dense"], tok, params, decode="compiled", autocast="bfloat16")
    references = {loop: HFSampler(tiny["dense"], tok, params, decode=decode, autocast="bfloat16")  # bf16 rounds
                  for loop, decode in (("_decode", "dynamic"), ("_decode_static", "static"))}  # differ per loop
    layout = engine._cache_layout()
    assert {t.dtype for kv in layout for t in kv} == {torch.bfloat16}
    unit = cache_bytes(layout, 4, 128)  # every call below: prompt + new tokens within one 128-slot bucket
    assert unit == 4 * 128 * 2 * 2 * 2 * 16 * 2  # rows × slots × layers × (K, V) × KV heads × head_dim × bytes
    monkeypatch.setattr(engine, "_cache_budget", lambda: int(2.5 * unit))
    loops = []

    def spy(name):
        loop = getattr(engine, name)
        return lambda *args: loops.append(name) or loop(*args)

    for name in ("_decode", "_decode_static"):
        monkeypatch.setattr(engine, name, spy(name))
    kept = []
    for n_prompts, group in ((4, 1), (3, 1), (2, 1), (4, 2), (4, 3), (4, 2), (4, 3)):
        b = engine.generate(PROMPTS[:n_prompts], group, SEEDS[:n_prompts])
        assert_same_samples(references[loops[-1]].generate(PROMPTS[:n_prompts], group, SEEDS[:n_prompts]), b)
        kept.append([rows for rows, _ in engine._static_caches])
        assert sum(map(allocated, engine._static_caches.values())) <= 2.5 * unit
    assert all(allocated(cache) == cache_bytes(layout, *shape) for shape, cache in engine._static_caches.items())
    assert kept == [[4], [4, 3], [4, 3, 2], [2, 8], [2, 8], [2, 8], [2, 8]]
    assert loops == ["_decode_static"] * 4 + ["_decode", "_decode_static", "_decode"]  # 12 rows: 3 units, dynamic


def test_compiled_mode_decodes_shapes_past_dynamos_recompile_limit_dynamically(tok, tiny, monkeypatch, caplog):
    """The compiled step is compiled once per (rows, cache slots) shape, and past dynamo's recompile limit (here set to
    2) dynamo would run the model's forward eagerly for every new shape: the static loop, eager, with a kept cache
    each. Past the limit a new shape decodes with the dynamic loop instead, said once in a warning; the shapes already
    compiled keep their compiled step, and the samples are the loop's own throughout. (The step itself is left
    uncompiled here, as in the test above; test_compiled_decode_on_cpu_stays_within_the_recompile_limit compiles it.)"""
    import logging

    import torch._dynamo

    monkeypatch.setattr(sampler_module, "compile_decode_step", lambda model, cuda: model)
    params = SamplingParams(temperature=0.8, max_new_tokens=6)
    engine = HFSampler(tiny["dense"], tok, params, decode="compiled")
    references = {"_decode": HFSampler(tiny["dense"], tok, params, decode="dynamic"),
                  "_decode_static": HFSampler(tiny["dense"], tok, params, decode="static")}
    loops = []

    def spy(name):
        loop = getattr(engine, name)
        return lambda *args: loops.append(name) or loop(*args)

    for name in references:
        monkeypatch.setattr(engine, name, spy(name))
    with torch._dynamo.config.patch(recompile_limit=2), caplog.at_level(logging.WARNING, "gspo.rollout.sampler"):
        for n_prompts, group in ((4, 1), (4, 2), (3, 1), (4, 1), (2, 1), (4, 2)):
            b = engine.generate(PROMPTS[:n_prompts], group, SEEDS[:n_prompts])
            assert_same_samples(references[loops[-1]].generate(PROMPTS[:n_prompts], group, SEEDS[:n_prompts]), b)
    assert loops == ["_decode_static"] * 2 + ["_decode", "_decode_static", "_decode", "_decode_static"]
    assert engine._compiled_shapes == {(4, 128), (8, 128)} == set(engine._static_caches)
    warnings = [r.getMessage() for r in caplog.records if "recompile limit" in r.getMessage()]
    assert len(warnings) == 1 and "(3, 128)" in warnings[0]
    fresh = HFSampler(tiny["dense"], tok, params, decode="compiled")
    with torch._dynamo.config.patch(recompile_limit=0):  # no compile at all: every shape decodes dynamically
        assert not fresh._compiles(4, 128) and fresh._compiled_shapes == set()


def test_multi_turn_episodes_decode_dynamically_under_auto(tmp_path, monkeypatch):
    """`auto` would compile the decode step on CUDA; episodes change their row count and context every turn, so the
    engine of an `env` run decodes dynamically unless rollout.decode says otherwise."""
    import gspo.rollout as rollout
    from conftest import DEMO, tiny_overrides
    from gspo.config import load_config
    from gspo.models import build_preset

    asked = []

    class Spy(HFSampler):
        def __init__(self, *args, decode="auto", **kwargs):
            asked.append(decode)
            super().__init__(*args, decode=decode, **kwargs)

    monkeypatch.setattr(rollout, "HFSampler", Spy)
    model, tokenizer = build_preset("tiny-moe")
    tools = ["env.name=tools", "env.tools=[calc]", "algorithm.loss=gspo_token"]
    for overrides, want in ((["rollout.decode=auto"], "auto"), ([*tools, "rollout.decode=auto"], "dynamic"),
                            ([*tools, "rollout.decode=static"], "static")):
        cfg = load_config(DEMO, tiny_overrides(tmp_path, *overrides))
        rollout.make_engine(cfg, model, tokenizer, out=tmp_path)
        assert asked[-1] == want


def test_the_run_checks_its_engine_before_any_compute(tmp_path):
    """What the built-in engine would refuse once built is refused by the trainer's start checks (ConfigError, nothing
    written), e.g. a static decode loop asked to record the routing; rollout.release_decode_cache reaches the engine."""
    import gspo.rollout as rollout
    from conftest import DEMO, tiny_overrides
    from gspo.config import ConfigError, load_config
    from gspo.models import build_preset
    from gspo.trainer import train

    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"rollout.decode=static: recording the rollout's routing"):
        train(load_config(DEMO, tiny_overrides(out, "rollout.decode=static", "algorithm.routing_replay=r3")))
    assert not (out / "metrics.jsonl").exists() and not (out / "cold_start").exists()
    model, tokenizer = build_preset("tiny-moe")
    cfg = load_config(DEMO, tiny_overrides(tmp_path, "rollout.release_decode_cache=true"))
    assert rollout.make_engine(cfg, model, tokenizer, out=tmp_path).release_cache


def test_the_built_in_engine_samples_under_the_trainers_mixed_precision(tmp_path):
    """trainer.mixed_precision=bfloat16: the engine that shares the float32 policy samples under the same autocast
    (test_an_autocast_engine_samples_the_mixed_precision_policy); a bf16 rollout.dtype copy needs none; without
    mixed precision it samples in float32."""
    import gspo.rollout as rollout
    from conftest import DEMO, tiny_overrides
    from gspo.config import load_config
    from gspo.models import build_preset

    model, tokenizer = build_preset("tiny-moe")
    for overrides, want in ((["trainer.mixed_precision=bfloat16"], torch.bfloat16), ([], None),
                            (["trainer.mixed_precision=bfloat16", "rollout.dtype=bfloat16"], None)):
        engine = rollout.make_engine(load_config(DEMO, tiny_overrides(tmp_path, *overrides)), model, tokenizer,
                                     out=tmp_path)
        assert engine.autocast == want and engine.shares_weights == ("rollout.dtype=bfloat16" not in overrides)


def test_the_engines_of_an_async_run_share_the_kept_cache_budget_of_their_device(tmp_path):
    """rollout.mode=async with the built-in engine: each of the rollout.workers processes samples with an engine of
    its own on the learner's device, beside the learner's evaluation engine, so each keeps at most
    KEPT_CACHE_SHARE / (workers + 1) of the device's memory in compiled-decode caches (all of them together the one
    share); a synchronous run's single engine keeps the whole share."""
    import gspo.rollout as rollout
    from conftest import DEMO, tiny_overrides
    from gspo.config import load_config
    from gspo.models import build_preset
    from gspo.rollout.sampler import KEPT_CACHE_SHARE

    model, tokenizer = build_preset("tiny-dense")
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # the CPU's memory: the budget's device here
    for overrides, engines in (([], 1), (["rollout.mode=async", "rollout.workers=2"], 3),
                               (["rollout.mode=async"], 2)):
        cfg = load_config(DEMO, tiny_overrides(tmp_path, *overrides))
        learner = rollout.make_engine(cfg, model, tokenizer, out=tmp_path)
        worker = rollout.worker_engine(cfg, model, tokenizer, worker=0, out=tmp_path)
        for engine in (learner, worker):
            assert engine.cache_share == pytest.approx(KEPT_CACHE_SHARE / engines), overrides
            assert engine._cache_budget() == int(KEPT_CACHE_SHARE / engines * total), overrides
    with pytest.raises(ValueError, match="cache_share must be in"):
        HFSampler(model, tokenizer, SamplingParams(max_new_tokens=2), cache_share=0.0)


@pytest.mark.slow
def test_compiled_decode_on_cpu_matches_the_dynamic_loop(tok, tiny):
    """torch.compile (inductor, no CUDA graphs) on this CPU: the same samples as the eager loop, call after call."""
    params = SamplingParams(temperature=0.9, max_new_tokens=16)
    compiled = HFSampler(tiny["dense"], tok, params, decode="compiled")
    dynamic = HFSampler(tiny["dense"], tok, params)
    for seeds in (SEEDS, [5, 6, 7, 8]):
        assert_same_samples(dynamic.generate(PROMPTS, 4, seeds), compiled.generate(PROMPTS, 4, seeds))


@pytest.mark.slow
def test_compiled_decode_on_cpu_is_not_recompiled_for_released_caches(tok, tiny):
    """rollout.release_decode_cache on the CPU frees the caches and makes new ones for the next call: the compiled
    step guards on the caches' shapes, not their addresses (transformers marks them unguarded static addresses), so
    the new caches run the graphs already compiled, and sample what the eager loop samples."""
    params = SamplingParams(temperature=0.9, max_new_tokens=16)
    compiled = HFSampler(tiny["dense"], tok, params, decode="compiled", release_cache=True)
    dynamic = HFSampler(tiny["dense"], tok, params)
    torch._dynamo.reset()
    stats = torch._dynamo.utils.counters["stats"]
    graphs = []
    for seeds in (SEEDS, [5, 6, 7, 8], SEEDS):
        assert_same_samples(dynamic.generate(PROMPTS, 4, seeds), compiled.generate(PROMPTS, 4, seeds))
        compiled.release()
        assert compiled._static_caches == {}
        graphs.append(stats["unique_graphs"])
    assert graphs[0] > 0 and graphs[1] == graphs[2] == graphs[0]


@pytest.mark.parametrize("groups", [2, 4])
@pytest.mark.parametrize("masked", [True, False])
def test_grouped_decode_attention_is_attention_over_the_repeated_heads(groups, masked):
    """gqa_decode_sdpa for one query token equals softmax(q·Kᵀ·scale + mask)·V of each query head with its KV head
    (h // groups) repeated, written out here; queries of several tokens, and masks per query head, take transformers'
    sdpa path unchanged."""
    import types

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from gspo.rollout.sampler import gqa_decode_sdpa

    torch.manual_seed(groups)
    module = types.SimpleNamespace(num_key_value_groups=groups, is_causal=True)
    batch, kv_heads, slots, dim = 3, 2, 11, 8
    key, value = torch.randn(batch, kv_heads, slots, dim), torch.randn(batch, kv_heads, slots, dim)
    query = torch.randn(batch, kv_heads * groups, 1, dim)
    mask = torch.ones(batch, 1, 1, slots, dtype=torch.bool)
    mask[0, ..., :4] = False  # left padding
    mask[2, ..., 7:] = False  # static-cache slots not written yet
    mask = mask if masked else None
    out, _ = gqa_decode_sdpa(module, query, key, value, mask, scaling=0.3)
    scores = query @ key.repeat_interleave(groups, 1).transpose(-1, -2) * 0.3
    if masked:
        scores = scores.masked_fill(~mask, float("-inf"))
    expected = (scores.softmax(-1) @ value.repeat_interleave(groups, 1)).transpose(1, 2)
    assert out.shape == (batch, 1, kv_heads * groups, dim)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)

    prompt = torch.randn(batch, kv_heads * groups, 5, dim)
    causal = torch.ones(5, slots, dtype=torch.bool).tril(slots - 5)[None, None].expand(batch, 1, 5, slots)
    plain, _ = sdpa_attention_forward(module, prompt, key, value, causal, scaling=0.3)
    assert torch.equal(gqa_decode_sdpa(module, prompt, key, value, causal, scaling=0.3)[0], plain)
    per_head = torch.rand(batch, kv_heads * groups, 1, slots) > 0.3  # a mask per query head: transformers' path too
    plain, _ = sdpa_attention_forward(module, query, key, value, per_head, scaling=0.3)
    assert torch.equal(gqa_decode_sdpa(module, query, key, value, per_head, scaling=0.3)[0], plain)


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_the_sampler_decodes_grouped_query_heads_without_copies_and_restores_the_model(tok, decode):
    """HFSampler decodes a grouped-query sdpa model with gqa_decode_sdpa (same samples as transformers' path), and
    the model's attention is sdpa again after a call, also one that raised; models without grouped KV heads, or
    with another attention, are left alone."""
    from gspo.rollout.sampler import GQA_DECODE, gqa_decoding

    model = build_model("dense", len(tok))
    seen: list[str] = []
    attention = model.model.layers[0].self_attn
    attention.register_forward_pre_hook(lambda module, args: seen.append(module.config._attn_implementation))
    params = SamplingParams(temperature=0.9, max_new_tokens=10)
    grouped = HFSampler(model, tok, params, decode=decode)
    plain = HFSampler(model, tok, params, decode=decode)
    plain.grouped_decode = False
    grouped.eos_ids = plain.eos_ids = []  # every row decodes all 10 tokens
    assert_same_samples(plain.generate(PROMPTS, 3, SEEDS), grouped.generate(PROMPTS, 3, SEEDS))
    calls = 10 if decode == "dynamic" else 11  # the prefill + 9 steps (+ the static cache's allocating forward)
    assert seen.count(GQA_DECODE) == calls and seen.count("sdpa") == calls
    assert model.config._attn_implementation == "sdpa"

    def fail() -> None:
        raise RuntimeError("stopped")

    grouped.between_tokens = fail
    with pytest.raises(RuntimeError, match="stopped"):
        grouped.generate(PROMPTS, 2, SEEDS)
    assert model.config._attn_implementation == "sdpa"

    seen.clear()
    model.set_attn_implementation("eager")
    HFSampler(model, tok, params, decode=decode).generate(PROMPTS[:1], 1, SEEDS[:1])
    assert set(seen) == {"eager"}
    heads = model.config.num_attention_heads
    unique_heads = Qwen3ForCausalLM(Qwen3Config(**{**model.config.to_dict(), "num_key_value_heads": heads}))
    with gqa_decoding(unique_heads):
        assert unique_heads.config._attn_implementation == "sdpa"


def test_decode_modes_are_checked(tok, tiny):
    from gspo.rollout.sampler import resolve_decode

    assert resolve_decode("auto", tiny["dense"], "cpu") == "dynamic"
    assert resolve_decode("auto", tiny["dense"], "cuda") == "compiled"
    assert resolve_decode("auto", tiny["moe"], "cuda") == "dynamic"  # not capturable in a CUDA graph (docstring)
    assert resolve_decode("static", tiny["moe"], "cuda") == "static"
    eager = build_model("dense", len(tok))
    eager.set_attn_implementation("eager")
    assert resolve_decode("auto", eager, "cuda") == "compiled"
    eager.config._attn_implementation = "flash_attention_2"  # (the package is not installed here)
    assert resolve_decode("auto", eager, "cuda") == "dynamic"  # compiled decode was measured with sdpa only
    with pytest.raises(ValueError, match="cannot be captured in a CUDA graph"):
        resolve_decode("compiled", tiny["moe"], "cuda")
    assert resolve_decode("compiled", tiny["moe"], "cpu") == "compiled"  # inductor alone: no graph capture
    with pytest.raises(ValueError, match="recording the rollout's routing"):
        HFSampler(tiny["moe"], tok, SamplingParams(), record_routing=True, decode="static")
    with pytest.raises(ValueError, match="one of dynamic, static, compiled"):
        resolve_decode("fast", tiny["dense"], "cpu")
    no_static = build_model("dense", len(tok))
    no_static._can_compile_fullgraph = False
    with pytest.raises(ValueError, match="does not support a static KV cache"):
        HFSampler(no_static, tok, SamplingParams(), decode="compiled")


# ---------------------------------------------------------------------------------------------- sanity


def test_larger_moe_batch_sanity(tok, tiny):
    """A larger run (8 prompts x 8 samples, 48 tokens, all filters on): well-formed output, no timing asserts."""
    prompts = [CHARS[i : i + 1 + i % 5] for i in range(8)]
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=8, max_new_tokens=48, stop=("0 0",))
    batch = HFSampler(tiny["moe"], tok, params).generate(prompts, 8, list(range(8)))
    assert len(batch) == 64 and batch.completion_ids.shape[1] <= 48
    assert torch.isfinite(batch.logprobs).all() and (batch.logprobs <= 0).all()
    check_layout(batch, tok, 48, {EOS})


def test_release_weights_frees_the_copy_until_update_weights(tok):
    """An own-copy engine's parameters are freed by release and come back, equal, from update_weights; generating
    from a released engine is an error, not a silent sample from freed memory."""
    trainer = build_model("moe", len(tok))
    sampler = HFSampler(trainer, tok, SamplingParams(max_new_tokens=8), dtype="bf16")
    before = sampler.generate(PROMPTS, 2, SEEDS)
    sampler.release()
    assert all(p.numel() == 0 for p in sampler.model.parameters())
    with pytest.raises(RuntimeError, match="released"):
        sampler.generate(PROMPTS, 2, SEEDS)
    sampler.update_weights(policy_weights(trainer), 1)
    for name, p in trainer.named_parameters():
        assert torch.equal(dict(sampler.model.named_parameters())[name], p.detach().to(torch.bfloat16)), name
    assert torch.equal(sampler.generate(PROMPTS, 2, SEEDS).completion_ids, before.completion_ids)
    shared = HFSampler(trainer, tok, SamplingParams(max_new_tokens=8))
    shared.release()  # a shared-weight engine has nothing to free
    assert all(p.numel() > 0 for p in trainer.parameters())


def test_an_abandoned_weight_stream_leaves_gradients_on(tok, tiny):
    """A stream the engine stops reading (here: it refuses a tensor) must not leave autograd disabled."""
    sampler = HFSampler(tiny["dense"], tok, SamplingParams(), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="unexpected tensor"):
        sampler.update_weights(policy_weights(tiny["moe"]), 1)
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_kv_cache_passed_by_the_forward_s_own_keyword(tok, tiny, decode, recwarn, caplog):
    """transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name warns on every call path
    and goes in 5.40): decoding and shared-prompt log-probs pass the cache by the keyword the forward takes, and read
    it back by the output's name, so neither warns (under older transformers both names are the old one)."""
    from gspo.logprobs import completion_logprobs

    batch = HFSampler(tiny["moe"], tok, SamplingParams(max_new_tokens=8), decode=decode).generate(PROMPTS, 2, SEEDS)
    with torch.no_grad():
        completion_logprobs(tiny["moe"], batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                            batch.completion_mask, trim_padding=True, share_prompts=True)
    said = [str(w.message) for w in recwarn] + [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "past_key_values" in m], said


@pytest.mark.slow
def test_compiled_decode_on_cpu_stays_within_the_recompile_limit(tok, tiny, caplog):
    """With dynamo's recompile limit at 1, the compiled loop compiles its step for the first shape only; a second
    shape decodes with the dynamic loop and compiles nothing (dynamo would otherwise run the step eagerly over a
    static cache, saying it hit the limit), and the first shape's compiled step still serves it afterwards. Samples:
    the eager loop's."""
    import logging

    import torch._dynamo

    params = SamplingParams(temperature=0.9, max_new_tokens=16)
    compiled = HFSampler(tiny["dense"], tok, params, decode="compiled")
    dynamic = HFSampler(tiny["dense"], tok, params)
    torch._dynamo.reset()
    stats = torch._dynamo.utils.counters["stats"]
    graphs = []
    with torch._dynamo.config.patch(recompile_limit=1), caplog.at_level(logging.WARNING, "torch._dynamo"):
        for n_prompts in (4, 2, 4):
            assert_same_samples(dynamic.generate(PROMPTS[:n_prompts], 4, SEEDS[:n_prompts]),
                                compiled.generate(PROMPTS[:n_prompts], 4, SEEDS[:n_prompts]))
            graphs.append(stats["unique_graphs"])
    assert graphs[0] > 0 and graphs[1] == graphs[2] == graphs[0]
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("torch")]  # e.g. "hit recompile_limit"
    assert compiled._compiled_shapes == {(16, 128)} == set(compiled._static_caches)


# ---- exact contracts of top-p and of `assemble` (tests that kill mutants the suite let through)

_TOKENIZER = preset_tokenizer()


def test_top_p_keeps_the_smallest_set_that_reaches_top_p_exactly():
    """Four equally likely tokens (0.25 each, exact in float32): top_p=0.5 is reached by two of them, so the third
    and fourth are dropped. A filter that drops a token only once the more probable ones strictly exceed top_p
    keeps a third token here."""
    scores = torch.zeros(1, 4)
    kept = torch.isfinite(filter_scores(scores, top_p=0.5))
    assert kept.sum().item() == 2
    two = torch.zeros(1, 2)  # 0.5 each: the first alone reaches top_p=0.5
    assert torch.isfinite(filter_scores(two, top_p=0.5)).sum().item() == 1


def test_assembled_text_drops_a_final_eos_that_is_not_a_special_token():
    """A completion that ends with any of the EOS ids (e.g. a generation_config EOS that the tokenizer does not treat
    as special) has that token out of its text; skip_special_tokens alone would keep it."""
    plain_eos = 9  # an ordinary token used as an extra EOS id
    assert _TOKENIZER.decode([plain_eos], skip_special_tokens=True) != ""
    samples = [Sample([5, 6], [7, 8, plain_eos], [-1.0] * 3, truncated=False),
               Sample([5, 6], [7, 8], [-1.0] * 2, truncated=True)]
    batch = assemble(samples, 2, _TOKENIZER, pad=0, eos=[_TOKENIZER.eos_token_id, plain_eos])
    assert batch.completions == [_TOKENIZER.decode([7, 8], skip_special_tokens=True)] * 2
    assert batch.truncated.tolist() == [False, True]


def test_assembled_versions_are_the_samples_own_per_token_versions():
    """A partial rollout's sample carries the policy version of each token; `assemble` keeps them (padding
    NO_VERSION), and a sample without them gets the batch's version."""
    samples = [Sample([5], [7, 8, 9], [-1.0] * 3, truncated=True, versions=[3, 3, 4]),
               Sample([5], [7], [-1.0], truncated=True)]
    batch = assemble(samples, 1, _TOKENIZER, pad=0, eos=[_TOKENIZER.eos_token_id], version=4)
    assert batch.versions.tolist() == [[3, 3, 4], [4, NO_VERSION, NO_VERSION]]


def test_a_prompt_that_fills_the_context_exactly_with_its_new_tokens_is_accepted():
    """prompt + max_new_tokens == max_len fits (the limit is `>`): a prompt of 4 tokens and 6 new ones in 10."""
    ids = [5, 6, 7, 8]
    assert encode_prompts(_TOKENIZER, [ids], 1, [0], 6, max_len=10) == [ids]
    with pytest.raises(ValueError, match="11 > max_len=10"):
        encode_prompts(_TOKENIZER, [ids], 1, [0], 7, max_len=10)


def test_eos_ids_lists_each_id_once():
    config = SimpleNamespace(eos_token_id=[_TOKENIZER.eos_token_id, 9, 9])
    assert eos_ids(_TOKENIZER, config) == [_TOKENIZER.eos_token_id, 9]
