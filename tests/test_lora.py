"""LoRA through peft (`gspo.lora`): what trains, the merged weights engines receive, sampling, checkpoints, the final
adapter and merged model, and the errors for targets LoRA cannot adapt."""

from __future__ import annotations

import copy
import json
import re
import sys

import pytest
import torch

peft = pytest.importorskip("peft")

from gspo.checkpoint import CheckpointError, save_checkpoint  # noqa: E402
from gspo.config import LoraConfig, ModelConfig, load_config  # noqa: E402
from gspo.logprobs import completion_logprobs  # noqa: E402
from gspo.lora import apply_lora, merged_weights, save_lora_final  # noqa: E402
from gspo.models import build_preset, build_tokenizer, load_model, save_model  # noqa: E402
from gspo.optim import make_optimizer  # noqa: E402
from gspo.parallel import ProcessGroup  # noqa: E402
from gspo.parallel.state import load_state, save_state  # noqa: E402
from gspo.rollout import HFSampler, SamplingParams, policy_weights  # noqa: E402
from gspo.rollout.weights import checkpoint_layout  # noqa: E402

# peft asks the model `is_gradient_checkpointing`, which transformers 5 deprecates: not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

KINDS = ["tiny-dense", "tiny-moe"]
TEXTS = ["12+34=46", "7+8=15", "50+49=99", "3+3=6"]
PROMPTS = ["12+34=", "7+8=", "50+49="]
GREEDY = SamplingParams(top_k=1, max_new_tokens=8)


def lora_model(kind: str, seed: int = 0, **cfg):
    """A preset wrapped with LoRA (r=4), its adapters' B set to random values so that merging changes the weights."""
    model, tok = load_model(kind, seed=seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        wrapped = apply_lora(model, LoraConfig(**{"r": 4, "alpha": 8.0, **cfg}))
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.data.normal_(0, 0.05)
    return wrapped, tok


def sft_loss(model, tok) -> torch.Tensor:
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return model(**batch, labels=labels).loss


def train_step(model, tok, optimizer, scheduler) -> float:
    loss = sft_loss(model, tok)
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def logits(model, tok) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**tok(TEXTS, return_tensors="pt", padding=True)).logits


# ------------------------------------------------------------------------------------------------- what trains


@pytest.mark.parametrize("kind", KINDS)
def test_only_adapters_require_grad_and_change(kind):
    model, tok = lora_model(kind)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if n in trainable)
    optimizer, scheduler = make_optimizer(model, 1e-2, 10)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(trainable)  # AdamW keeps state for these only
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_step(model, tok, optimizer, scheduler)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable


def test_all_linear_targets_the_linear_layers_but_the_head():
    dense, _ = lora_model("tiny-dense")
    assert set(dense.peft_config["default"].target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj"}
    moe, _ = lora_model("tiny-moe")  # experts (fused 3-D weights) and router are not nn.Linear: attention only
    adapted = {n.rpartition(".lora_A")[0] for n, _ in moe.named_parameters() if ".lora_A." in n}
    assert adapted and all(n.split(".")[-1] in {"q_proj", "k_proj", "v_proj", "o_proj"} for n in adapted)
    assert not moe.peft_config["default"].target_parameters
    assert "lm_head" not in str(dense.peft_config["default"].target_modules)


def test_config_section():
    assert ModelConfig().lora is None
    cfg = load_config(overrides=["model.lora.r=8", "model.lora.target_modules=[q_proj, v_proj]"])
    assert cfg.model.lora == LoraConfig(r=8, target_modules=["q_proj", "v_proj"])
    for bad in ({"r": 0}, {"alpha": 0}, {"dropout": 1.0}, {"target_modules": []}, {"target_modules": "q_proj"}):
        with pytest.raises(ValueError):
            LoraConfig(**bad)


# ------------------------------------------------------------------------------------------------ bad targets


@pytest.mark.parametrize(("kind", "targets", "says"), [
    ("tiny-dense", ["qproj"], ["['qproj'] match no module", "q_proj", "down_proj"]),
    ("tiny-moe", ["gate_up_proj"], ["match no module", "fused 3-D parameters", "gate_up_proj [8, 256, 128]"]),
    ("tiny-moe", ["q_proj", "experts"], ["'experts'", "Qwen3MoeExperts, not an nn.Linear", "fused 3-D"]),
    ("tiny-moe", ["gate"], ["Qwen3MoeTopKRouter, not an nn.Linear"]),
    ("tiny-dense", ["lm_head"], ["tied to ['model.embed_tokens.weight']"]),
    ("tiny-dense", ["proj"], ["['proj'] match no module"]),  # a name's tail is not its last dotted part: q_proj
])
def test_targets_lora_cannot_adapt_are_explained(kind, targets, says):
    model, _ = load_model(kind)
    with pytest.raises(ValueError) as err:
        apply_lora(model, LoraConfig(target_modules=targets))
    for text in says:
        assert text in str(err.value)
    assert not hasattr(model, "peft_config")  # refused before peft touched the model


class _Wrapped(torch.nn.Module):
    """A module that is not an nn.Linear around one that is (as adapters or quantisation wrappers are)."""

    def __init__(self, inner: torch.nn.Linear) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_all_linear_names_the_layers_in_full_when_a_short_name_is_also_a_module_that_is_not_linear():
    """"all-linear" names the targets by their last part (q_proj) only when those select exactly the linear layers:
    here layer 0's down_proj is a wrapper (not an nn.Linear) around the linear `inner`, so "down_proj" would make
    peft adapt the wrapper, which it refuses. Each linear layer is then named in full, and every one is adapted."""
    model, _ = load_model("tiny-dense")
    mlp = model.model.layers[0].mlp
    mlp.down_proj = _Wrapped(mlp.down_proj)
    head = model.get_output_embeddings()
    linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}
    wrapped = apply_lora(model, LoraConfig(r=2))
    adapted = {n.removeprefix("base_model.model.").rpartition(".lora_A")[0] for n, _ in wrapped.named_parameters()
               if ".lora_A." in n}
    assert adapted == linear


def test_a_seeded_apply_lora_leaves_the_callers_random_state_as_it_was():
    """With `seed`, the adapters are drawn from a generator seeded with it and the global RNG is left as it was: what
    the caller draws next (sampling, dropout) does not depend on whether LoRA was applied, and the adapters do not
    depend on what the caller drew before."""
    first_model, second_model = load_model("tiny-dense")[0], load_model("tiny-dense")[0]
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    first = apply_lora(first_model, LoraConfig(r=4), seed=5)
    assert torch.equal(torch.random.get_rng_state(), before)
    torch.rand(17)  # another global state: the same adapters
    second = apply_lora(second_model, LoraConfig(r=4), seed=5)
    a = {n: p for n, p in first.named_parameters() if "lora_A" in n}
    b = {n: p for n, p in second.named_parameters() if "lora_A" in n}
    assert a and a.keys() == b.keys() and all(torch.equal(p, b[n]) for n, p in a.items())


def test_missing_peft_says_how_to_install(monkeypatch):
    model, _ = load_model("tiny-dense")
    monkeypatch.setitem(sys.modules, "peft", None)  # makes `import peft` raise ImportError
    with pytest.raises(ImportError, match="pip install peft"):
        apply_lora(model, LoraConfig())


@pytest.mark.parametrize("peft_missing", [False, True])
def test_a_bad_target_or_no_peft_is_refused_before_the_cold_start(tmp_path, monkeypatch, peft_missing):
    """LoRA is applied after the cold start, but a typo in a target (or peft missing) is refused when the model is
    built: nothing computed or written that would block the corrected command ('already holds a run')."""
    from conftest import DEMO, tiny_overrides
    from gspo.config import ConfigError
    from gspo.runfolder import run_started
    from gspo.trainer import train

    def no_cold_start(*args, **kwargs):
        raise AssertionError("the cold start ran")

    monkeypatch.setattr("gspo.trainer.cold_start", no_cold_start)
    if peft_missing:
        monkeypatch.setitem(sys.modules, "peft", None)
    out = tmp_path / "run"
    lora = "{r: 4}" if peft_missing else "{r: 4, target_modules: [q_prj]}"
    with pytest.raises(ConfigError, match=r"model\.lora: .*pip install peft" if peft_missing else
                       r"model\.lora\.target_modules \['q_prj'\] match no module .*q_proj"):
        train(load_config(DEMO, tiny_overrides(out, f"model.lora={lora}")))
    assert not run_started(out) and not (out / "cold_start").exists()


def test_adapters_start_the_same_in_a_run_and_in_its_resume_before_the_first_checkpoint(tmp_path, monkeypatch):
    """The adapters' initial A matrices are drawn from the run seed, not from the global RNG: a fresh run's cold start
    (a model with dropout) consumes that RNG and a resume, which loads the saved cold-start model, does not, so a run
    interrupted before its first checkpoint restarted from other adapters than the uninterrupted one."""
    from conftest import DEMO, SimulatedCrash, crash_after, tiny_overrides, varied_reward
    from gspo.models import build_preset, save_model
    from gspo.rewards import REWARDS
    from gspo.trainer import train

    monkeypatch.setitem(REWARDS, "varied", varied_reward)
    model, tokenizer = build_preset("tiny-dense", seed=0)
    model.config.attention_dropout = 0.5  # the cold start draws dropout masks from the global RNG
    save_model(model, tokenizer, tmp_path / "dropout-model")
    starts = []

    def recorded(*args, **kwargs):
        wrapped = apply_lora(*args, **kwargs)
        starts.append({n: p.detach().clone() for n, p in wrapped.named_parameters() if "lora_A" in n})
        return wrapped

    monkeypatch.setattr("gspo.trainer.apply_lora", recorded)
    cfg = load_config(DEMO, tiny_overrides(tmp_path / "run", f"model.name={tmp_path / 'dropout-model'}",
                                           "model.lora={r: 4}", "trainer.disable_dropout=false", "trainer.steps=2",
                                           "trainer.checkpoint_every=0", "trainer.eval_every=0", "data.eval_size=1",
                                           "rewards.functions={varied: 1.0}"))
    with pytest.raises(SimulatedCrash):
        train(cfg, callbacks=[crash_after(1)])
    train(cfg, resume=True)  # no checkpoint: starts over from the saved cold-start model
    assert len(starts) == 2 and starts[0].keys() == starts[1].keys()
    assert all(torch.equal(a, starts[1][n]) for n, a in starts[0].items())


@pytest.mark.parametrize("base", ["preset", "relative"])
def test_an_adapter_folder_names_the_base_it_was_trained_on(tmp_path, monkeypatch, base):
    """Without a cold start the adapters name `model.name` as their base: a preset with the seed its weights came from
    (trainer.seed=1: `load_model` of the folder built the seed-0 preset, logits 1.1 off, silently), a relative folder
    as its absolute path (it was not found from another working folder). The adapter folder then loads as the run's
    merged model, from anywhere."""
    from conftest import DEMO, tiny_overrides, varied_reward
    from gspo.models import build_preset, save_model
    from gspo.rewards import REWARDS
    from gspo.trainer import train

    monkeypatch.setitem(REWARDS, "varied", varied_reward)
    monkeypatch.chdir(tmp_path)
    name = "tiny-dense"
    if base == "relative":
        save_model(*build_preset("tiny-dense", seed=1), tmp_path / "base")
        name = "base"
    out = tmp_path / "run"
    train(load_config(DEMO, tiny_overrides(out, f"model.name={name}", "cold_start=null", "trainer.seed=1",
                                           "model.lora={r: 4, merged_final: true}", "optim.lr=1e-2", "trainer.steps=1",
                                           "trainer.eval_every=0", "data.eval_size=1",
                                           "rewards.functions={varied: 1.0}")))
    named = json.loads((out / "final" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert named == ("tiny-dense@seed=1" if base == "preset" else str(tmp_path / "base"))
    monkeypatch.chdir(tmp_path.parent)
    adapter, tok = load_model(str(out / "final"))  # what `gspo eval RUN` loads
    merged, _ = load_model(str(out / "final" / "merged"))
    torch.testing.assert_close(logits(adapter, tok), logits(merged, tok), atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------- merged weights


@pytest.mark.parametrize("kind", KINDS)
def test_policy_weights_are_the_merged_model(kind):
    model, _ = lora_model(kind)
    own = {n: t.clone() for n, t in model.get_base_model().state_dict().items()}
    streamed = dict(policy_weights(model))
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    assert list(streamed) == list(load_model(kind)[0].state_dict()) == list(reference)  # the base's names, in order
    for name, tensor in streamed.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6)
    assert any(not torch.equal(streamed[n], own[n.replace("q_proj.", "q_proj.base_layer.")]) for n in streamed
               if "q_proj" in n)  # the adapters were merged in ...
    assert all(torch.equal(t, own[n]) for n, t in model.get_base_model().state_dict().items())  # ... in a copy


@pytest.mark.parametrize("kind", KINDS)
def test_merged_weights_from_a_gathered_state_equal_the_models(kind):
    """Under FSDP the final merged model is written from the peft model's full state dict gathered on rank 0
    (`merged_weights(model, state)`, its own formula for nn.Linear adapters): the same tensors as peft's merge of the
    model's own, names and order included."""
    model, _ = lora_model(kind)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    own = dict(merged_weights(model))
    from_state = dict(merged_weights(model, state))
    assert list(from_state) == list(own)
    for name, tensor in from_state.items():
        torch.testing.assert_close(tensor, own[name], rtol=0, atol=1e-6)
    for name, p in model.named_parameters():  # the state is read, not the model: changing the model changes nothing
        if "lora_B" in name:
            p.data.zero_()
    assert all(torch.equal(t, from_state[n]) for n, t in merged_weights(model, state))


@pytest.mark.parametrize("gathered", [False, True])
def test_merged_weights_of_a_bfloat16_model_keep_its_dtype(gathered):
    """peft keeps a bfloat16 model's adapters in float32: the merged W + B·A must still be bfloat16, the dtype of the
    engine's weights and of the merged model written to final/merged (float32 doubled its size on disk)."""
    model, _ = load_model("tiny-dense", dtype="bfloat16")
    model = apply_lora(model, LoraConfig(r=4, alpha=8.0), seed=0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    state = {k: v.clone() for k, v in model.state_dict().items()} if gathered else None
    streamed = dict(merged_weights(model, state))
    base = model.get_base_model().state_dict()
    assert {name: t.dtype for name, t in streamed.items()} == {
        name.replace(".base_layer.", "."): t.dtype for name, t in base.items() if "lora_" not in name}
    assert {t.dtype for t in streamed.values()} == {torch.bfloat16}


def test_merged_weights_with_the_adapters_disabled_are_the_base_weights():
    """Inside peft's `disable_adapter()` the model computes its base weights alone: the merged stream, which engines
    load as the policy, must be those weights then, not W + B·A."""
    model, tok = lora_model("tiny-dense")
    plain = dict(merged_weights(model))
    with model.disable_adapter():
        disabled = dict(merged_weights(model))
        want = logits(model, tok)
    base = {n.replace(".base_layer.", "."): t for n, t in model.get_base_model().state_dict().items()
            if "lora_" not in n}
    assert disabled.keys() == base.keys()
    assert all(torch.equal(t, base[n]) for n, t in disabled.items())
    assert any(not torch.equal(t, plain[n]) for n, t in disabled.items())  # the adapters do change the weights
    merged, _ = load_model("tiny-dense")
    merged.load_state_dict(disabled)
    torch.testing.assert_close(logits(merged, tok), want, rtol=0, atol=1e-5)


def test_merged_weights_merge_the_active_adapter_only():
    """A peft model can hold adapters that are not active (`add_adapter` leaves the active one as it was): the merged
    stream is what the model computes, so an inactive adapter adds nothing to it."""
    model, _ = lora_model("tiny-dense")
    before = dict(merged_weights(model))
    model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B.other" in name:
            p.data.normal_(0, 0.05)
    assert model.active_adapters == ["default"]
    after = dict(merged_weights(model))
    assert after.keys() == before.keys() and all(torch.equal(t, before[n]) for n, t in after.items())


def test_checkpoint_layout_of_peft_model_is_the_base_models():
    """What vLLM loads: the merged stream mapped to the saved-checkpoint layout (transformers 5 splits fused MoE
    experts back per expert), exactly as for the plain model."""
    model, _ = lora_model("tiny-moe")
    plain, _ = load_model("tiny-moe")
    names = [n for n, _ in checkpoint_layout(model)(policy_weights(model))]
    assert names == [n for n, _ in checkpoint_layout(plain)(policy_weights(plain))]
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in names


@pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys did not match:RuntimeWarning")
def test_merged_weights_of_peft_parameter_adapters():
    """peft's own all-linear on a transformers-5 MoE also adapts the fused experts and the router (ParamWrapper, one
    per parameter, nested): the merged stream handles those too."""
    base, _ = load_model("tiny-moe")
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules="all-linear", task_type="CAUSAL_LM"))
    if not model.peft_config["default"].target_parameters:
        pytest.skip("this peft does not adapt fused MoE parameters")
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    streamed = dict(merged_weights(model))
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    assert list(streamed) == list(reference)
    for name, tensor in streamed.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("kind", KINDS)
def test_sampler_on_peft_model_matches_merged_copy(kind):
    model, tok = lora_model(kind)
    merged = copy.deepcopy(model).merge_and_unload()
    shared = HFSampler(model, tok, GREEDY)
    assert shared.shares_weights
    expected = HFSampler(merged, tok, GREEDY).generate(PROMPTS, 1, [0, 1, 2])
    got = shared.generate(PROMPTS, 1, [0, 1, 2])
    assert torch.equal(got.completion_ids, expected.completion_ids)
    # the learner's log-probabilities through the peft model are the merged model's
    batch = expected
    args = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
    lp, _ = completion_logprobs(model, *args)
    ref, _ = completion_logprobs(merged, *args)
    torch.testing.assert_close(lp, ref, rtol=0, atol=1e-4)


def test_own_copy_engine_built_before_apply_lora_takes_the_merged_stream():
    """The trainer's order: the engine (here an own copy, as under FSDP or rollout.dtype) is built from the plain
    model, then apply_lora; every sync then streams merged weights under the plain model's names."""
    base, tok = load_model("tiny-dense")
    engine = HFSampler(base, tok, GREEDY, own_copy=True)
    model = apply_lora(base, LoraConfig(r=4, alpha=8.0))
    optimizer, scheduler = make_optimizer(model, 5e-2, 10)
    for _ in range(3):
        train_step(model, tok, optimizer, scheduler)
    engine.update_weights(policy_weights(model), version=1)
    merged = copy.deepcopy(model).merge_and_unload()
    expected = HFSampler(merged, tok, GREEDY).generate(PROMPTS, 1, [0, 1, 2])
    assert torch.equal(engine.generate(PROMPTS, 1, [0, 1, 2]).completion_ids, expected.completion_ids)


# ---------------------------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_round_trip_is_exact(tmp_path, kind):
    group = ProcessGroup()
    model, tok = lora_model(kind)
    optimizer, scheduler = make_optimizer(model, 1e-2, 10)
    for _ in range(2):
        train_step(model, tok, optimizer, scheduler)
    save_state(group, tmp_path, 2, model=model, optimizer=optimizer, scheduler=scheduler, tokenizer=tok,
               state={"step": 2}, keep_last=2)
    folder = tmp_path / "checkpoints" / "step_00000002" / "model"
    assert (folder / "adapter_model.safetensors").is_file() and not (folder / "model.safetensors").exists()
    expected_loss = train_step(model, tok, optimizer, scheduler)

    fresh, _ = lora_model(kind, seed=0)  # the base from the run's model.name and seed, as on resume
    for p in fresh.parameters():
        if p.requires_grad:  # adapters unlike the saved ones: the load must restore them
            p.data.uniform_()
    fresh_opt, fresh_sched = make_optimizer(fresh, 1e-2, 10)
    assert load_state(group, folder.parent, fresh, fresh_opt, fresh_sched) == {"step": 2}
    assert train_step(fresh, tok, fresh_opt, fresh_sched) == expected_loss  # bit for bit
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for a, b in zip(optimizer.state.values(), fresh_opt.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_must_fit_the_adapters(tmp_path):
    model, tok = lora_model("tiny-dense")
    optimizer, scheduler = make_optimizer(model, 1e-2, 10)
    path = save_checkpoint(tmp_path, 1, model=model, tokenizer=tok, optimizer=optimizer, scheduler=scheduler,
                           state={})
    other, _ = lora_model("tiny-dense", r=8)
    other_opt, other_sched = make_optimizer(other, 1e-2, 10)
    with pytest.raises(CheckpointError, match="do not fit"):
        load_state(ProcessGroup(), path, other, other_opt, other_sched)
    full, _ = load_model("tiny-dense")  # written without LoRA: no adapter tensors in it
    full_opt, full_sched = make_optimizer(full, 1e-2, 10)
    full_path = save_checkpoint(tmp_path / "full", 1, model=full, tokenizer=tok, optimizer=full_opt,
                                scheduler=full_sched, state={})
    with pytest.raises(CheckpointError, match="LoRA adapters"):
        load_state(ProcessGroup(), full_path, model, optimizer, scheduler)


# ---------------------------------------------------------------------------------------------- final model


@pytest.mark.parametrize("kind", KINDS)
def test_final_adapter_and_merged_model_load_back(tmp_path, kind):
    model, tok = lora_model(kind)
    out = save_lora_final(model, tok, tmp_path / "final", merged=True, base_model="/models/base")
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "/models/base"
    expected = logits(model, tok)
    base, _ = load_model(kind)
    reloaded = peft.PeftModel.from_pretrained(base, out)
    torch.testing.assert_close(logits(reloaded, tok), expected, rtol=0, atol=1e-6)
    merged, merged_tok = load_model(str(out / "merged"))
    assert not hasattr(merged, "peft_config") and merged_tok.get_vocab() == tok.get_vocab()
    torch.testing.assert_close(logits(merged, tok), expected, rtol=0, atol=1e-4)
    save_lora_final(model, tok, tmp_path / "plain", merged=False)
    assert not (tmp_path / "plain" / "merged").exists()


def test_an_adapter_folder_loads_as_a_trainable_model(tmp_path, capsys):
    """A LoRA run's final adapter folder as the next run's model.name (`load_model` merges it into its base): peft had
    frozen the base, and merging kept it frozen, so `--check` said "0 trained" without a warning and the run failed in
    torch's AdamW with "optimizer got an empty parameter list". It now trains every weight, as a model folder does."""
    from conftest import DEMO, tiny_overrides
    from gspo.cli import main

    model, tok = lora_model("tiny-dense")
    save_lora_final(model, tok, tmp_path / "final", merged=False, base_model="tiny-dense@seed=0")
    merged, _ = load_model(str(tmp_path / "final"))
    assert all(p.requires_grad for p in merged.parameters())
    cfg = tmp_path / "c.yaml"
    cfg.write_text(DEMO.read_text())
    assert main(["train", str(cfg), "--check", *tiny_overrides(tmp_path / "run", "cold_start=null",
                                                                  f"model.name={tmp_path / 'final'}")]) == 0
    assert re.search(r"model: .*, (\S+) parameters \(\1 trained\)", capsys.readouterr().out)  # every one, not 0


def _rows(vocab: int):
    """Two groups' rows: left-padded prompts, right-padded completions (as a rollout gives them)."""
    g = torch.Generator().manual_seed(7)
    prompt_ids = torch.randint(3, vocab, (4, 5), generator=g)
    completion_ids = torch.randint(3, vocab, (4, 6), generator=g)
    prompt_mask, completion_mask = torch.ones_like(prompt_ids), torch.ones_like(completion_ids)
    prompt_mask[2:, :2] = 0
    completion_mask[1, 4:] = 0
    completion_mask[3, 2:] = 0
    return prompt_ids, prompt_mask, completion_ids, completion_mask


@pytest.mark.parametrize("kind", KINDS)
def test_training_forward_of_a_lora_model_takes_the_chunked_head(kind):
    """A LoRA model's training forward runs the base model's backbone (adapters active) and the chunked head: the LM
    head module never runs (no N×T×V logits); values and the adapters' gradients equal peft's own forward's."""
    from gspo.logprobs import _backbone_and_head

    model, _ = lora_model(kind)
    rows = _rows(model.config.vocab_size)
    assert _backbone_and_head(model) is not None

    def run(**kwargs):
        logprobs, _ = completion_logprobs(model, *rows, **kwargs)
        mask = rows[3].bool()  # padded positions: 0 on the chunked path, a value on the full one
        (logprobs[mask] * torch.linspace(-1, 1, int(mask.sum()))).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return logprobs.detach(), grads

    want, want_grads = run(chunk_size=0)  # through PeftModel.forward and the full logits
    calls = []
    hook = model.get_output_embeddings().register_forward_hook(lambda *_: calls.append(1))
    got, grads = run(trim_padding=True)
    hook.remove()
    assert not calls
    mask = rows[3].bool()
    torch.testing.assert_close(got[mask], want[mask], atol=2e-5, rtol=1e-5)
    assert grads.keys() == want_grads.keys() and all("lora_" in n for n in grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, want_grads[name], atol=1e-5 * float(want_grads[name].abs().max()), rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_kl_reference_is_the_base_with_the_adapters_off_not_a_copy(kind):
    """`BaseReference`: the log-probs of the base model the adapters were put on (bit for bit), with no parameter of
    its own; the policy's adapters and training mode are back afterwards."""
    from gspo.lora import BaseReference

    model, _ = lora_model(kind)  # adapters with non-zero B: the policy differs from its base
    base, _ = load_model(kind, seed=0)
    rows = _rows(model.config.vocab_size)
    model.train()
    with torch.no_grad():
        policy_before = completion_logprobs(model, *rows)[0]
        reference = BaseReference(model)
        got = completion_logprobs(reference, *rows)[0]
        want = completion_logprobs(base.eval(), *rows)[0]
        policy_after = completion_logprobs(model, *rows)[0]
    assert torch.equal(got, want)
    assert not torch.allclose(policy_before, want, atol=1e-3)  # the adapters matter, and they were off
    assert torch.equal(policy_after, policy_before) and model.training
    own = {id(p) for p in model.parameters()}
    assert all(id(p) in own for p in reference.parameters())  # nothing copied


def test_the_kl_reference_leaves_a_policy_in_eval_mode_in_eval_mode():
    """`BaseReference` switches the policy to eval mode for the reference forward and then back to the mode it was
    in: a policy evaluated (no dropout) must not come back in training mode."""
    from gspo.lora import BaseReference

    model, _ = lora_model("tiny-dense")
    model.eval()
    with torch.no_grad():
        completion_logprobs(BaseReference(model), *_rows(model.config.vocab_size))
    assert not model.training and not any(m.training for m in model.modules())


def test_trainer_runs_lora_and_writes_an_adapter_and_a_merged_model(tmp_path, monkeypatch):
    """`model.lora` in a training run (with a KL term to the base): only adapters train, final/ is a peft adapter
    folder with the merged model in final/merged (loadable by gspo), and a resume continues from the adapter
    checkpoint."""
    from conftest import DEMO, tiny_overrides, varied_reward
    from gspo.rewards import REWARDS
    from gspo.trainer import train

    monkeypatch.setitem(REWARDS, "varied", varied_reward)  # per test: the registry stays as the other tests expect
    out = tmp_path / "run"
    overrides = tiny_overrides(out, "model.lora={r: 4, alpha: 8, merged_final: true}", "trainer.checkpoint_every=1",
                               "rewards.functions={addition: 1.0, varied: 0.5}", "algorithm.kl_beta=0.1",
                               "trainer.steps=2", "optim.lr=1e-2")
    summary = train(load_config(DEMO, overrides))
    assert summary["status"] == "completed"
    kl = [json.loads(line)["kl_ref"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(kl) == 2 and all(k >= 0 for k in kl) and kl[-1] > 0  # KL to the base (adapters off) as they move
    assert (out / "final" / "adapter_config.json").is_file() and (out / "final" / "adapter_model.safetensors").is_file()
    merged, _ = load_model(str(out / "final" / "merged"))
    cold, _ = load_model(str(out / "cold_start"))
    changed = [n for n, p in merged.state_dict().items() if not torch.equal(p, cold.state_dict()[n])]
    assert changed and all("proj" in n for n in changed)  # the adapters moved the targeted projections only
    adapter, _ = load_model(str(out / "final"))  # the adapter folder: its base (cold_start) with the adapters merged
    assert all(torch.allclose(p, merged.state_dict()[n], atol=1e-6) for n, p in adapter.state_dict().items())
    # the last checkpoint's adapters load the same way (`gspo eval` of a stopped run's checkpoint): it names its base
    for folder in (out / "final", out / "checkpoints" / "step_00000002" / "model"):
        named = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
        assert named == str((out / "cold_start").absolute())
    checkpoint, _ = load_model(str(out / "checkpoints" / "step_00000002" / "model"))
    assert all(torch.equal(p, adapter.state_dict()[n]) for n, p in checkpoint.state_dict().items())
    summary = train(load_config(DEMO, [*overrides[:-2], "trainer.steps=3", "optim.lr=1e-2"]), resume=True)
    assert summary["status"] == "completed"
    # a moved run evaluates on its own cold start, not on what now sits at the recorded path: it failed after a
    # move, and a model put at the old path was merged with the adapters silently (31 % where the run's was 0 %)
    final, _ = load_model(str(out / "final"))
    moved = tmp_path / "moved"
    out.rename(moved)
    other, _ = build_preset("tiny-moe", seed=7)
    save_model(other, build_tokenizer(), out / "cold_start")
    again, _ = load_model(str(moved / "final"))
    assert all(torch.equal(p, final.state_dict()[n]) for n, p in again.state_dict().items())
