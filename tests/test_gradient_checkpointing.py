"""trainer.gradient_checkpointing: the same log-probs and gradients as without it, the sampler (KV cache) unaffected,
a short training run identical to the one without it, and the combination with MoE routing replay refused."""

from __future__ import annotations

import pytest
import torch

import gspo.trainer
from conftest import DEMO, tiny_overrides, varied_reward
from gspo.config import ConfigError, load_config
from gspo.logprobs import completion_logprobs
from gspo.models import enable_gradient_checkpointing, load_model
from gspo.rewards import REWARDS
from gspo.rollout import HFSampler, SamplingParams
from gspo.tracking import read_metrics
from gspo.trainer import train


def _batch(vocab: int):
    """8 rows, two prompts of 4 completions each (so that prompt sharing would apply), ragged lengths."""
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, vocab, (2, 9), generator=g).repeat_interleave(4, 0)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[4:, :3] = 0
    prompt_ids = prompt_ids * prompt_mask
    completion_ids = torch.randint(3, vocab, (8, 7), generator=g)
    lengths = torch.tensor([7, 3, 5, 1, 6, 7, 2, 4])
    completion_mask = (torch.arange(7)[None, :] < lengths[:, None]).long()
    return prompt_ids, prompt_mask, completion_ids * completion_mask, completion_mask


def _logprobs_and_grads(model, batch, **kwargs):
    model.zero_grad(set_to_none=True)
    logprobs, _ = completion_logprobs(model, *batch, **kwargs)
    mask = batch[3].bool()
    (logprobs[mask] * torch.linspace(-1.0, 2.0, int(mask.sum()))).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logprobs.detach()[mask], grads


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
@pytest.mark.parametrize("options", [{}, {"trim_padding": True, "share_prompts": False}, {"chunk_size": 0}])
def test_checkpointing_gives_the_same_logprobs_and_gradients(preset, options):
    """In train mode (where checkpointing acts), bit for bit: the backward's recompute is the same forward."""
    plain, _ = load_model(preset, seed=3)
    checkpointed, _ = load_model(preset, seed=3)
    enable_gradient_checkpointing(checkpointed)
    assert any(getattr(m, "gradient_checkpointing", False) for m in checkpointed.modules())
    batch = _batch(plain.config.vocab_size)
    want, want_grads = _logprobs_and_grads(plain.train(), batch, **options)
    got, grads = _logprobs_and_grads(checkpointed.train(), batch, **options)
    assert torch.equal(got, want)
    assert grads.keys() == want_grads.keys() and len(grads) == len(list(plain.parameters()))
    for name, g in grads.items():
        assert torch.equal(g, want_grads[name]), name


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_prompt_sharing_gives_way_to_checkpointing(preset):
    """Prompt sharing runs completions against the prompts' KV cache, which checkpointed layers drop in train mode:
    under checkpointing it falls back to one forward per bucket, exactly the unshared computation (and shared vs
    unshared agree to rounding: tests/test_logprobs.py::test_prompt_sharing_equals_the_full_logits_path)."""
    plain, _ = load_model(preset, seed=3)
    checkpointed, _ = load_model(preset, seed=3)
    enable_gradient_checkpointing(checkpointed)
    batch = _batch(plain.config.vocab_size)
    want, want_grads = _logprobs_and_grads(plain.train(), batch, trim_padding=True, share_prompts=False)
    for share in (True, None):  # forced, and auto (it would share here: 2 prompts for 8 rows)
        got, grads = _logprobs_and_grads(checkpointed.train(), batch, trim_padding=True, share_prompts=share)
        assert torch.equal(got, want)
        assert all(torch.equal(g, want_grads[name]) for name, g in grads.items())


def test_the_sampler_keeps_its_kv_cache_under_checkpointing():
    """The sampler runs the model in eval mode, where checkpointed layers use the cache as usual: same samples and
    log-probs as without checkpointing, and the model is back in train mode afterwards."""
    outputs = []
    for checkpointing in (False, True):
        model, tokenizer = load_model("tiny-dense", seed=1)
        if checkpointing:
            enable_gradient_checkpointing(model)
        model.train()
        sampler = HFSampler(model, tokenizer, SamplingParams(max_new_tokens=8))
        outputs.append(sampler.generate(["12+34=", "5+6="], 3, [0, 1]))
        assert model.training
    a, b = outputs
    assert torch.equal(a.completion_ids, b.completion_ids) and a.completions == b.completions
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-dense"])
def test_a_short_run_with_checkpointing_equals_the_run_without(tmp_path, preset, monkeypatch):
    """Two RL steps with and without checkpointing, same metrics. tiny-moe (the demo's model): π_old recomputed with
    routing capture, full-layout forwards, bit-identical; tiny-dense: trimmed forwards, whose prompt sharing gives way
    to checkpointing, so equal to rounding."""
    enabled = []

    def spy(model):
        enable_gradient_checkpointing(model)
        enabled.append(model)

    monkeypatch.setattr(gspo.trainer, "enable_gradient_checkpointing", spy)
    monkeypatch.setitem(REWARDS, "varied", varied_reward)  # for this test only (not the session-wide fixture)
    runs = []
    for checkpointing in (False, True):
        out = tmp_path / f"gc_{checkpointing}"
        train(load_config(DEMO, tiny_overrides(out, f"model.name={preset}", "cold_start=null", "trainer.steps=2",
                                               "trainer.eval_every=0", "data.eval_size=1",
                                               "rewards.functions={varied: 1.0}",
                                               f"trainer.gradient_checkpointing={str(checkpointing).lower()}")))
        runs.append(read_metrics(out / "metrics.jsonl"))
    plain, checkpointed = runs
    assert len(enabled) == 1 and enabled[0].training  # the second run's policy, left in train mode by the updates
    assert [r["step"] for r in checkpointed] == [1, 2]
    for a, b in zip(plain, checkpointed, strict=True):
        for key in ("reward_mean", "loss", "grad_norm", "ratio_mean", "clip_frac_tokens", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
        assert b["skipped_updates"] == 0


def test_checkpointing_with_routing_replay_is_refused():
    with pytest.raises(ConfigError, match=r"routing_replay=r2 .*gradient_checkpointing"):
        load_config(DEMO, ["algorithm.routing_replay=r2", "trainer.gradient_checkpointing=true"])
