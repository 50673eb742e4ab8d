"""The library's extension points, used as a user would, with no change to the trainer:

* a new rollout engine implements `gspo.rollout.base.RolloutEngine` (here a deliberately simple one: no KV cache, a
  full forward per token, its own weight copy fed from the weight stream) and trains through `gspo.trainer.train`;
* a new objective is one registry entry (`gspo.objectives.register_objective`) and trains through the same loop;
* Dr.GRPO's constant normaliser is the generation budget, whatever the batch's longest response.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from conftest import DEMO, tiny_overrides
from gspo import trainer as trainer_module
from gspo.config import load_config
from gspo.learner import LearnSettings, learn
from gspo.objectives import OBJECTIVES, Objective, gspo_loss
from gspo.rollout import SamplingParams
from gspo.rollout.assemble import Sample, assemble, encode_prompts, eos_ids, pad_id
from gspo.rollout.sampler import row_seed, sample_from_logits
from gspo.tracking import read_metrics
from gspo.trajectory import Trajectory


class NoCacheEngine:
    """A rollout engine written against the protocol alone: its own copy of the policy, a full forward per generated
    token, sampling with gspo's per-row seeded inverse-CDF draw."""

    shares_weights = False

    def __init__(self, model: torch.nn.Module, tokenizer, params: SamplingParams) -> None:
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.tokenizer, self.params, self.version = tokenizer, params, 0
        self.pad_id, self.eos_ids = pad_id(tokenizer), eos_ids(tokenizer)
        self.updates: list[int] = []
        self.released = 0

    @torch.no_grad()
    def generate(self, prompts, group_size, seeds, params=None) -> Trajectory:
        p = params or self.params
        encoded = encode_prompts(self.tokenizer, prompts, group_size, seeds, p.max_new_tokens)
        samples = []
        for ids, seed in zip(encoded, seeds, strict=True):
            for j in range(group_size):
                uniforms = torch.rand(p.max_new_tokens, generator=torch.Generator().manual_seed(row_seed(seed, j)))
                tokens, logprobs = [], []
                for t in range(p.max_new_tokens):
                    logits = self.model(input_ids=torch.tensor([ids + tokens], device=self.model.device)).logits[:, -1]
                    u = uniforms[t:t + 1].to(logits.device)
                    token, logprob = sample_from_logits(logits, u, p.temperature, p.top_k, p.top_p)
                    tokens.append(int(token))
                    logprobs.append(float(logprob))
                    if tokens[-1] in self.eos_ids:
                        break
                samples.append(Sample(ids, tokens, logprobs, truncated=tokens[-1] not in self.eos_ids))
        return assemble(samples, group_size, self.tokenizer, self.pad_id, self.eos_ids, self.version)

    @torch.no_grad()
    def update_weights(self, weights, version) -> None:
        own = self.model.state_dict()
        for name, tensor in weights:
            own[name].copy_(tensor)
        self.version = version
        self.updates.append(version)

    def release(self) -> None:
        self.released += 1


def test_a_new_engine_trains_through_the_trainer_untouched(tmp_path, monkeypatch):
    built: list[NoCacheEngine] = []

    def make(cfg, model, tokenizer, *, out, dist=None):
        engine = NoCacheEngine(model, tokenizer, SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens))
        built.append(engine)
        return engine

    monkeypatch.setattr(trainer_module, "make_engine", make)  # where a user's script would pass its own engine
    cfg = load_config(DEMO, tiny_overrides(tmp_path, "cold_start=null", "trainer.steps=2", "rollout.max_new_tokens=3",
                                           "rollout.prompts_per_step=2", "rollout.group_size=2",
                                           "algorithm.minibatches=2", "data.eval_size=2", "trainer.eval_every=0"))
    summary = trainer_module.train(cfg)
    (engine,) = built
    assert engine.updates == [0, 1, 2]  # the first sync (step 0), then one after each step
    assert engine.released == 2  # once per step, after its rollout
    assert summary["status"] == "completed" and len(read_metrics(tmp_path / "metrics.jsonl")) == 2
    final = trainer_module.load_model(str(tmp_path / "final"))[0].state_dict()
    assert all(torch.equal(final[k], v.cpu()) for k, v in engine.model.state_dict().items())  # synced to the last step


def test_a_registered_objective_trains_without_other_changes(tmp_path, monkeypatch):
    calls = []

    def halved_gspo(logprobs, old_logprobs, advantages, mask, **kw):
        calls.append(kw["normaliser"])
        loss, metrics = gspo_loss(logprobs, old_logprobs, advantages, mask, **kw)
        return loss / 2, metrics

    spec = Objective(loss=halved_gspo, eps_low=1e-3, eps_high=2e-3, normalise_by="sequences",
                     summary="GSPO at half the step size (a test objective)")
    monkeypatch.setitem(OBJECTIVES, "halved_gspo", spec)
    cfg = load_config(DEMO, tiny_overrides(tmp_path, "cold_start=null", "trainer.steps=1", "algorithm.loss=halved_gspo",
                                           "rollout.prompts_per_step=2", "rollout.group_size=2",
                                           "algorithm.minibatches=2", "data.eval_size=2", "trainer.eval_every=0"))
    assert (cfg.algorithm.eps_low, cfg.algorithm.eps_high) == (1e-3, 2e-3)
    trainer_module.train(cfg)
    assert calls == [2.0, 2.0]  # two minibatches of 2 sequences each, one process


def test_dr_grpo_is_normalised_by_the_generation_budget():
    """learn() gives Dr.GRPO L = max_new_tokens: the same responses padded to a wider batch give the same update."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)  # a stand-in: the policy's log-probabilities are given below

    def losses(width: int) -> list[float]:
        seen = []

        def loss(logprobs, old_logprobs, advantages, mask, **kw):
            out = OBJECTIVES["dr_grpo"].loss(logprobs, old_logprobs, advantages, mask, **kw)
            seen.append(float(out[0].detach()))
            return out

        spec = dataclasses.replace(OBJECTIVES["dr_grpo"], loss=loss)
        n, t = 4, 3
        lp = torch.full((n, width), -1.0, requires_grad=True)
        mask = torch.zeros(n, width, dtype=torch.long)
        mask[:, :t] = 1
        traj = Trajectory(prompt_ids=torch.ones(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1, dtype=torch.long),
                          completion_ids=torch.ones(n, width, dtype=torch.long), completion_mask=mask,
                          logprobs=torch.full((n, width), -1.1), truncated=torch.zeros(n, dtype=torch.bool),
                          completions=[""] * n, prompt_index=torch.arange(n))
        settings = LearnSettings(objective=spec, eps_low=0.2, eps_high=0.27, old_logprobs="rollout",
                                 max_new_tokens=8)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("gspo.learner.completion_logprobs", lambda *a, **k: (lp, None))
            learn(model, optimizer, scheduler, traj, torch.tensor([1.0, -1.0, 0.5, -0.5]),
                  [torch.arange(4)], settings)
        return seen

    assert losses(3) == losses(6)  # L = 8 both times, not the batch width
