"""MoE routing capture and replay (`gspo.moe`): Routing Replay R2 / R3 (GSPO §5.3, arXiv 2510.11370), the sampler's
routing record, expert volatility, and their wiring into the config and the trainer.

Models are tiny randomly initialised MoEs of every supported family, with a large init std (0.1) so that routing
is decisive and generations end on EOS at varied steps."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from conftest import DEMO, record_objective, tiny_overrides, varied_reward
from gspo.config import ConfigError, load_config
from gspo.hooks import MoERouting
from gspo.logprobs import completion_logprobs
from gspo.models import build_tokenizer
from gspo.moe import (
    FREE,
    RoutingCapture,
    find_routers,
    is_moe,
    require_replay_support,
    routing_change,
    routing_change_counts,
)
from gspo.rewards import REWARDS
from gspo.rollout import HFSampler, SamplingParams
from gspo.tracking import read_metrics
from gspo.trainer import train

COMMON = dict(vocab_size=48, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              intermediate_size=64, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, initializer_range=0.1)
FAMILIES = {
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(moe_intermediate_size=32, num_experts=8,
                                                            num_experts_per_tok=2, head_dim=16, norm_topk_prob=True,
                                                            **COMMON)),
    "qwen2_moe": lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(moe_intermediate_size=32, num_experts=8,
                                                            num_experts_per_tok=2, shared_expert_intermediate_size=32,
                                                            **COMMON)),
    "olmoe": lambda: OlmoeForCausalLM(OlmoeConfig(num_experts=8, num_experts_per_tok=2, **COMMON)),
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(num_local_experts=8, num_experts_per_tok=2, **COMMON)),
}


def build(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return FAMILIES[family]().eval()


def inputs(seed: int = 0, rows: int = 3, length: int = 7) -> dict[str, torch.Tensor]:
    """Random ids with left padding on some rows (positions count real tokens only, as in training)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, COMMON["vocab_size"], (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    for r in range(1, rows):
        mask[r, : r] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


def forward(model, batch, replay=None):
    """Logits and the captured Routing of one forward, optionally replaying `replay`."""
    with RoutingCapture(model, replay=replay) as cap:
        logits = model(**batch).logits
    return logits, cap.take()


def perturb_routers(model, scale: float = 0.5, seed: int = 1) -> None:
    """An update that changes routing: noise on every router's weights."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, router, _ in find_routers(model):
            router.weight.add_(scale * router.weight.std() * torch.randn(router.weight.shape, generator=g))


# ------------------------------------------------------------------------------------------------ capture, replay


@pytest.mark.parametrize("family", list(FAMILIES))
def test_replaying_the_own_routing_is_exact(family):
    model, batch = build(family), inputs()
    logits, routing = forward(model, batch)
    assert routing.chosen.shape == (batch["input_ids"].numel(), 2, 2)  # [tokens, layers, k]
    assert torch.equal(routing.chosen, routing.used)
    replayed, again = forward(model, batch, replay=routing.chosen.view(3, 7, 2, 2))
    assert torch.equal(replayed, logits)  # bit for bit: same experts, same gate weights
    assert torch.equal(again.used, routing.chosen)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_replay_uses_the_recorded_experts_after_an_update(family):
    model, batch = build(family), inputs()
    _, old = forward(model, batch)
    perturb_routers(model)
    free_logits, free = forward(model, batch)
    replayed_logits, replayed = forward(model, batch, replay=old.chosen)
    changed = (free.chosen != old.chosen).any(-1)  # [tokens, layers]: routing the update changed
    assert changed.any(), "the perturbation must change some routing for this test to mean anything"
    assert torch.equal(replayed.used, old.chosen)  # replay imposes π_old's experts ...
    assert not torch.equal(replayed.used, free.chosen)  # ... which differ from what the router now picks
    # the first router sees the same input either way, so its own choice is the free forward's
    assert torch.equal(replayed.chosen[:, 0], free.chosen[:, 0])
    assert not torch.allclose(replayed_logits, free_logits)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_router_gets_gradient_under_replay(family):
    model, batch = build(family), inputs()
    _, old = forward(model, batch)
    perturb_routers(model)
    model.zero_grad()
    with RoutingCapture(model, replay=old.chosen):
        logits = model(**batch).logits
    torch.log_softmax(logits, -1)[..., 5].sum().backward()
    for name, router, _ in find_routers(model):
        assert router.weight.grad is not None, name
        assert torch.isfinite(router.weight.grad).all() and router.weight.grad.abs().sum() > 0, name


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_replayed_gate_weights_come_from_the_current_router(norm_topk_prob):
    """Weights are softmax(current logits) at the replayed experts, renormalised when the model does so."""
    model = build("qwen3_moe")
    _, router, adapter = find_routers(model)[0]
    router.norm_topk_prob = norm_topk_prob
    h = torch.randn(5, COMMON["hidden_size"], generator=torch.Generator().manual_seed(0))
    logits, weights, own = router(h)
    forced = torch.tensor([[0, 1], [2, 3], [FREE, FREE], [7, 6], [4, 0]])
    _, new_weights, idx = adapter.replay(router, (logits, weights, own), forced)
    expect_idx = torch.where((forced < 0).any(-1, keepdim=True), own, forced)
    assert torch.equal(idx, expect_idx)
    probs = torch.softmax(logits.float(), -1).gather(-1, expect_idx)
    torch.testing.assert_close(new_weights, probs / probs.sum(-1, keepdim=True) if norm_topk_prob else probs)
    assert torch.equal(new_weights[2], weights[2])  # a FREE token keeps the router's own weights exactly


def test_free_entries_keep_the_routers_choice():
    model, batch = build("qwen3_moe"), inputs()
    _, old = forward(model, batch)
    perturb_routers(model)
    _, free = forward(model, batch)
    replay = old.chosen.clone().long()
    replay[::2] = FREE  # every other token unrecorded
    _, partial = forward(model, batch, replay=replay)
    assert torch.equal(partial.used[1::2], old.chosen[1::2])
    assert torch.equal(partial.used[::2], partial.chosen[::2])  # own choice where FREE
    assert torch.equal(partial.used[0, 0], free.chosen[0, 0])


def test_capture_leaves_no_hooks_behind_and_checks_its_input():
    model, batch = build("qwen3_moe"), inputs()
    routers = [r for _, r, _ in find_routers(model)]
    _, routing = forward(model, batch)
    assert all(not r._forward_hooks for r in routers)
    with pytest.raises(ValueError, match="routes 21 tokens but the replay routing holds 7"):
        forward(model, batch, replay=routing.chosen[:7])
    assert all(not r._forward_hooks for r in routers)  # removed on error too
    with pytest.raises(ValueError, match="must end in"):
        RoutingCapture(model, replay=routing.chosen[..., :1])
    with RoutingCapture(model) as cap:
        model(**batch)
        model(**batch)
    with pytest.raises(RuntimeError, match="one call per router"):
        cap.take()


def test_dense_models_are_refused():
    dense = Qwen3ForCausalLM(Qwen3Config(**{**COMMON, "head_dim": 16}))
    assert not is_moe(dense) and is_moe(build("qwen3_moe"))
    with pytest.raises(ValueError, match="has no MoE router"):
        RoutingCapture(dense)
    with pytest.raises(ValueError, match="needs a Mixture-of-Experts model"):
        require_replay_support(dense, "r2")


def test_an_moe_family_without_adapter_is_named(monkeypatch):
    import gspo.moe as moe

    monkeypatch.setattr(moe, "_ADAPTERS", {})
    monkeypatch.setattr(moe, "_builtins_loaded", True)
    with pytest.raises(ValueError, match=r"register one with gspo\.moe\.register_router"):
        require_replay_support(build("qwen3_moe"), "r3")


# ------------------------------------------------------------------------------------------------- R3: the sampler


@pytest.fixture(scope="module")
def sampled():
    """A tiny Qwen3-MoE over the preset tokenizer, and rollouts with varied lengths (EOS, stop strings, padding)."""
    tok = build_tokenizer()
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**COMMON, "vocab_size": len(tok)}, moe_intermediate_size=32,
                                               num_experts=8, num_experts_per_tok=2, head_dim=16)).eval()
    return model, tok


@pytest.mark.parametrize("drop_finished_rows", [True, False])
def test_r3_routing_from_the_sampler_equals_a_teacher_forced_forward(sampled, drop_finished_rows):
    model, tok = sampled
    sampler = HFSampler(model, tok, SamplingParams(max_new_tokens=10, stop=("7",)), record_routing=True)
    sampler.drop_finished_rows = drop_finished_rows
    batch = sampler.generate(["12+3=", "5+77=", "1+1=", "99+99="], 4, [1, 2, 3, 4])
    lengths = batch.completion_mask.sum(-1)
    assert len(set(lengths.tolist())) > 1 and (batch.prompt_mask == 0).any()  # the layout is exercised
    routing = batch.extras["routing"]
    s, t = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    assert routing.shape == (len(batch), s + t, 2, 2) and routing.dtype == torch.int16

    with torch.no_grad(), RoutingCapture(model) as cap:
        completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
    teacher = cap.take().chosen.view(routing.shape)
    recorded = routing >= 0
    assert torch.equal(routing[recorded], teacher[recorded])
    # FREE exactly on prompt padding and on each completion's last token and after
    expect_free = torch.cat([batch.prompt_mask == 0,
                             torch.arange(t)[None, :] >= (lengths[:, None] - 1)], dim=1)
    assert torch.equal((routing < 0).all(-1).all(-1), expect_free)
    assert torch.equal(recorded.all(-1).all(-1), ~expect_free)


def test_routing_is_not_recorded_by_default(sampled):
    model, tok = sampled
    batch = HFSampler(model, tok, SamplingParams(max_new_tokens=4)).generate(["1+2="], 2, [0])
    assert "routing" not in batch.extras
    assert all(not r._forward_hooks for _, r, _ in find_routers(model))


def test_r3_replay_of_the_engines_routing_reproduces_its_logprobs(sampled):
    """Replaying the engine's routing in the training forward gives the engine's log-probabilities (same weights)."""
    model, tok = sampled
    engine = copy.deepcopy(model)
    batch = HFSampler(engine, tok, SamplingParams(max_new_tokens=6), record_routing=True).generate(
        ["12+3=", "5+77="], 3, [5, 6])
    with torch.no_grad(), RoutingCapture(model, replay=batch.extras["routing"]) as cap:
        logprobs, _ = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                          batch.completion_mask)
    mask = batch.completion_mask.bool()
    assert (logprobs[mask] - batch.logprobs[mask]).abs().max() < 1e-4
    used, routing = cap.take().used.view(batch.extras["routing"].shape), batch.extras["routing"]
    assert torch.equal(used[routing >= 0], routing[routing >= 0])


def test_r3_on_rollouts_without_engine_routing_is_an_error_not_training_without_replay(sampled):
    """A library caller's trajectory without `extras['routing']` under r3 trained silently as routing_replay=none."""
    from gspo.hooks import MoERouting
    model, tok = sampled
    batch = HFSampler(copy.deepcopy(model), tok, SamplingParams(max_new_tokens=4)).generate(["12+3="], 2, [5])
    MoERouting(model, "r2").start(batch)  # r2 replays the trainer's own π_old routing: nothing needed from the engine
    with pytest.raises(ValueError, match=r"routing_replay=r3 .* carry none"):
        MoERouting(model, "r3").start(batch)


# ------------------------------------------------------------------------------------------------------ volatility

routings = st.integers(1, 6).flatmap(lambda tokens: st.lists(
    st.permutations(list(range(8))).map(lambda p: p[:2]), min_size=tokens * 3, max_size=tokens * 3))


def as_routing(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int16).view(-1, 3, 2)  # [tokens, layers=3, k=2]


@settings(max_examples=60, deadline=None)
@given(routings, routings, st.data())
def test_routing_change_properties(a_rows, b_rows, data):
    n = min(len(a_rows), len(b_rows)) // 3 * 3
    a, b = as_routing(a_rows[:n]), as_routing(b_rows[:n])
    change = routing_change(a, b)
    assert 0.0 <= change <= 1.0
    assert change == routing_change(b, a)  # |B \ A| = |A \ B| for sets of equal size k
    assert routing_change(a, a) == 0.0
    assert routing_change(a, a.flip(-1)) == 0.0  # order within the top-k does not matter
    # one swapped expert of two counts as half of that (token, layer)
    swapped = a.clone()
    swapped[0, 0, 0] = next(e for e in range(8) if e not in a[0, 0].tolist())
    assert routing_change(a, swapped) == pytest.approx(1 / (2 * a.shape[0] * a.shape[1]))
    # masked tokens and FREE entries are not counted
    valid = torch.tensor(data.draw(st.lists(st.booleans(), min_size=a.shape[0], max_size=a.shape[0])))
    masked = routing_change(a, b, valid)
    if valid.any():
        assert masked == routing_change(a[valid], b[valid])
    else:
        assert masked != masked  # NaN: nothing counted
    free = a.clone()
    free[0] = FREE
    if a.shape[0] > 1:
        assert routing_change(free, b) == routing_change(a[1:], b[1:])


@settings(max_examples=30, deadline=None)
@given(routings, routings, st.integers(0, 6))
def test_volatility_of_shares_adds_up_to_the_whole_batchs(a_rows, b_rows, cut):
    """Under torchrun each process measures its share of the last minibatch: their counts add up to the whole
    batch's volatility (an average of per-process fractions does not when the shares count different tokens)."""
    n = min(len(a_rows), len(b_rows)) // 3 * 3
    a, b = as_routing(a_rows[:n]), as_routing(b_rows[:n])
    cut = min(cut, a.shape[0])
    parts = [routing_change_counts(a[:cut], b[:cut]), routing_change_counts(a[cut:], b[cut:])]
    changed, counted = (sum(p[i] for p in parts) for i in (0, 1))
    assert changed / counted == pytest.approx(routing_change(a, b))


def test_precision_ratio_noise_of_shares_adds_up_to_the_whole_batchs():
    """`precision_ratio_std_seq` with one sequence per process read 0 (a std per process, averaged); the hooks now
    sum each process's moments: two shares' sums give the whole batch's stds."""
    from gspo.hooks import _ratio_stds, _ratio_sums, precision_ratio_metrics
    g = torch.Generator().manual_seed(0)
    trainer = -torch.rand(4, 6, generator=g) * 3
    engine = trainer + 1e-3 * torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.3
    whole = precision_ratio_metrics(trainer, engine, mask)
    ref = (torch.where(mask, trainer - engine, 0.0).sum(-1) / mask.sum(-1)).exp().std()
    assert whole["precision_ratio_std_seq"] == pytest.approx(float(ref), rel=1e-4)
    assert whole["precision_ratio_std_token"] == pytest.approx(float((trainer - engine)[mask].exp().std()), rel=1e-4)
    for cut in (1, 2, 3):  # one sequence on a process, the rest on the other
        sums = [x + y for x, y in zip(_ratio_sums(trainer[:cut], engine[:cut], mask[:cut]),
                                      _ratio_sums(trainer[cut:], engine[cut:], mask[cut:]), strict=True)]
        assert _ratio_stds(sums) == pytest.approx(whole, rel=1e-9)


def test_routing_change_of_disjoint_sets_is_one():
    a = torch.tensor([[[0, 1]], [[2, 3]]])
    assert routing_change(a, a + 4) == 1.0
    with pytest.raises(ValueError, match="shapes differ"):
        routing_change(a, a[:1])


# ----------------------------------------------------------------------------------------- config and trainer


def test_config_checks_routing_replay_before_compute():
    """The config rules of routing replay (a dense model is refused at training start: see test_config.py)."""
    assert load_config(DEMO, ["algorithm.routing_replay=r2"]).algorithm.routing_replay == "r2"
    with pytest.raises(ConfigError, match="use old_logprobs=recompute"):
        load_config(DEMO, ["algorithm.routing_replay=r2", "algorithm.old_logprobs=rollout"])
    with pytest.raises(ConfigError, match="routing_replay"):
        load_config(DEMO, ["algorithm.routing_replay=r4"])


@pytest.fixture
def varied(monkeypatch):
    """The `varied` reward (differs within groups even for an untrained model, so updates happen), for one test."""
    monkeypatch.setitem(REWARDS, "varied", varied_reward)


@pytest.fixture
def spy_grpo(monkeypatch):
    """(logprobs, old_logprobs, mask) of every call of the grpo objective."""
    return record_objective(monkeypatch, "grpo")


RL = ("cold_start=null", "trainer.steps=2", "rewards.functions={varied: 1.0}", "algorithm.loss=grpo",
      "trainer.eval_every=0", "data.eval_size=1", "optim.lr=3e-3", "optim.warmup_steps=0")


@pytest.mark.usefixtures("varied")
@pytest.mark.parametrize("replay", ["none", "r2", "r3"])
def test_training_logs_volatility_and_replays(tmp_path, spy_grpo, replay):
    train(load_config(DEMO, tiny_overrides(tmp_path, *RL, f"algorithm.routing_replay={replay}")))
    records = read_metrics(tmp_path / "metrics.jsonl")
    for r in records:
        assert 0.0 <= r["expert_volatility"] <= 1.0
        assert r["precision_ratio_std_token"] < 1e-4 and r["precision_ratio_std_seq"] < 1e-4  # one fp32 engine
        assert ("rollout_routing_mismatch" in r) == (replay == "r3")
    assert any(r["expert_volatility"] > 0 for r in records)  # lr 3e-3 moves the routers
    if replay == "r3":  # the engine and trainer share weights and dtype: same routing
        assert all(r["rollout_routing_mismatch"] == 0.0 for r in records)
    minibatches = 4
    for k, (logprobs, old, mask) in enumerate(spy_grpo):
        if k % minibatches == 0:  # on-policy, with or without replay of the own routing: ratio exactly 1
            assert torch.equal(logprobs[mask], old[mask])


@pytest.mark.usefixtures("varied")
def test_bf16_engine_logs_precision_ratio_noise(tmp_path):
    train(load_config(DEMO, tiny_overrides(tmp_path, *RL, "rollout.dtype=bfloat16", "algorithm.old_logprobs=rollout",
                                           "algorithm.routing_replay=r3")))
    for r in read_metrics(tmp_path / "metrics.jsonl"):
        assert r["precision_ratio_std_token"] > 1e-4  # bf16 vs fp32 numerics, same weights
        assert r["precision_ratio_std_seq"] > 0
        assert "expert_volatility" not in r  # no trainer π_old forward to compare against


def test_a_replay_row_with_any_free_entry_keeps_the_routers_choice():
    """A row of a replay tensor holding FREE anywhere (not only a whole FREE row) keeps the router's own top-k."""
    model = build("qwen3_moe")
    _, router, adapter = find_routers(model)[0]
    h = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    logits, weights, own = router(h)
    forced = torch.tensor([[FREE, 3], [5, FREE], [7, 6]])
    _, new_weights, idx = adapter.replay(router, (logits, weights, own), forced)
    assert torch.equal(idx[:2], own[:2]) and idx[2].tolist() == [7, 6]
    assert torch.equal(new_weights[:2], weights[:2])


class _Group:
    """One process: merging and summing are the identity."""

    def merge_rows(self, value, minibatches):
        return value

    def all_sum(self, values):
        return list(values)


def _hook_on(model, batch, mode: str, routing: torch.Tensor | None = None) -> tuple[MoERouting, torch.Tensor]:
    """A MoERouting hook after the π_old forward of `batch` (one minibatch of all rows); its π_old logits."""
    extras = {} if routing is None else {"routing": routing}
    hook = MoERouting(model, mode)
    hook.start(_Traj(extras, batch["attention_mask"].bool()))
    rows = torch.arange(batch["input_ids"].shape[0])
    with torch.no_grad(), hook.old_forward(rows):
        logits = model(**batch).logits
    hook.old_done(_Group(), [rows])
    return hook, logits


class _Traj:
    def __init__(self, extras: dict, token_mask: torch.Tensor) -> None:
        self.extras, self.token_mask = extras, token_mask

    def __len__(self) -> int:
        return self.token_mask.shape[0]


def test_r2_replays_the_pi_old_routing_in_the_update_forwards():
    model, batch = build("qwen3_moe"), inputs()
    _, old = forward(model, batch)
    hook, _ = _hook_on(model, batch, "r2")
    perturb_routers(model)
    free_logits, free = forward(model, batch)
    replayed_logits, _ = forward(model, batch, replay=old.chosen)
    assert not torch.equal(free.chosen, old.chosen)
    rows = torch.arange(3)
    with torch.no_grad(), hook.update_forward(1, rows, last=True):
        logits = model(**batch).logits
    assert torch.equal(logits, replayed_logits) and not torch.allclose(logits, free_logits)


def test_r3_pi_old_forward_replays_the_engines_routing():
    model, batch = build("qwen3_moe"), inputs()
    other = build("qwen3_moe")
    perturb_routers(other)
    _, engine = forward(other, batch)  # an engine whose routing differs from the trainer's
    engine = engine.used.view(3, 7, 2, 2)
    _, logits = _hook_on(model, batch, "r3", engine)
    free_logits, free = forward(model, batch)
    replayed_logits, _ = forward(model, batch, replay=engine)
    assert not torch.equal(free.chosen.view(3, 7, 2, 2), engine)
    assert torch.equal(logits, replayed_logits) and not torch.allclose(logits, free_logits)


def test_expert_volatility_counts_real_tokens_only_and_needs_an_update():
    """Volatility = routing_change(π_old's routing, π_θ's on the last update, real tokens only); a step with a single
    update (nothing changed yet) reports none."""
    model, batch = build("qwen3_moe"), inputs()
    mask = batch["attention_mask"].bool()
    rows = torch.arange(3)
    _, old = forward(model, batch)

    hook, _ = _hook_on(model, batch, "none")
    with torch.no_grad(), hook.update_forward(0, rows, last=True):
        model(**batch)
    hook.update_metrics(0, rows, None, None)
    assert "expert_volatility" not in hook.batch_metrics(None, None)  # one update: π_θ = π_old, nothing measured

    hook, _ = _hook_on(model, batch, "none")
    perturb_routers(model)
    _, new = forward(model, batch)
    with torch.no_grad(), hook.update_forward(0, rows, last=False):
        model(**batch)
    hook.update_metrics(0, rows, None, None)
    with torch.no_grad(), hook.update_forward(1, rows, last=True):
        model(**batch)
    hook.update_metrics(1, rows, None, None)
    volatility = hook.batch_metrics(None, None)["expert_volatility"]
    a, b = old.chosen.view(3, 7, 2, 2), new.chosen.view(3, 7, 2, 2)
    assert routing_change(a, b, mask) != routing_change(a, b)  # padding routes changed too: the mask matters here
    assert volatility == routing_change(a, b, mask)
