"""trainer.compile: the decoder layers compiled by torch.compile for the training forwards and backwards
(`gspo.models.compiled_layers`), and the head's float32 passes (`gspo.logprobs.fused_head`), compute what eager mode
computes, leave the model as it was, keep the first minibatch on-policy, and are refused where they cannot work before
any compute."""

from __future__ import annotations

import pytest
import torch

from conftest import (
    CPU_COMPILE_ROUNDS_AS_EAGER,
    DEMO,
    ragged_trajectory,
    record_objective,
    slow_on_cpu,
    tiny_overrides,
)
from gspo.config import ConfigError, load_config
from gspo.logprobs import completion_logprobs
from gspo.models import build_preset, compiled_layers, decoder_layers, enable_gradient_checkpointing
from gspo.tracking import read_metrics
from gspo.trainer import train


def _logprobs_and_grads(model, traj, compile: bool, autocast: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The log-probs of `traj` and the gradients of their sum; `autocast`: the forward under bf16 autocast (the
    trainer's mixed precision; the backward outside it, as the trainer runs it)."""
    amp = torch.autocast(traj.prompt_ids.device.type, dtype=torch.bfloat16, enabled=autocast)
    with compiled_layers(model, compile), amp:
        lp, _ = completion_logprobs(model, traj.prompt_ids, traj.prompt_mask, traj.completion_ids,
                                    traj.completion_mask, trim_padding=True)
    (lp * traj.completion_mask).sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    return lp.detach(), grads


def _model(variant: str):
    """The dense preset; "lora+checkpointing": wrapped with LoRA adapters (`test_lora.lora_model`: their B random, so
    they matter) and trained with gradient checkpointing, whose recompute then runs the compiled layer again in the
    backward."""
    if variant == "plain":
        return build_preset("tiny-dense", seed=0)[0]
    pytest.importorskip("peft")
    from test_lora import lora_model

    model, _ = lora_model("tiny-dense")
    enable_gradient_checkpointing(model)
    return model


# LoRA with gradient checkpointing compiles graphs of its own (~40 s on a 2-core CPU): in the slow suite
@pytest.mark.parametrize("variant", ["plain", pytest.param("lora+checkpointing", marks=pytest.mark.slow)])
def test_compiled_layers_compute_the_eager_logprobs_and_gradients_and_leave_the_model_eager(device, variant):
    model = _model(variant)
    model.to(device).train()
    layers = decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers
    traj = ragged_trajectory(model.cpu(), n=8).to(device)
    model.to(device)
    torch._dynamo.reset()  # compiled from scratch here, whatever ran before in this process
    captured = torch._dynamo.utils.counters["stats"]["calls_captured"]
    eager, eager_grads = _logprobs_and_grads(model, traj, compile=False)
    compiled, compiled_grads = _logprobs_and_grads(model, traj, compile=True)
    assert torch.allclose(compiled, eager, atol=2e-5)
    for e, c in zip(eager_grads, compiled_grads, strict=True):  # every parameter's, relative to its largest entry
        assert (c - e).abs().max() <= 1e-5 * e.abs().max().clamp(min=1e-12)
    with torch.no_grad(), compiled_layers(model):  # π_old's forward: the same values as the training forward
        old, _ = completion_logprobs(model, traj.prompt_ids, traj.prompt_mask, traj.completion_ids,
                                     traj.completion_mask, trim_padding=True)
    assert torch.allclose(old, compiled, atol=1e-6, rtol=0)
    assert torch._dynamo.utils.counters["stats"]["calls_captured"] > captured  # compiled (not eager all along)
    assert all("forward" not in layer.__dict__ for layer in layers)  # eager again, class and state dict untouched
    assert type(layers[0]).__name__ == "Qwen3DecoderLayer"
    assert all(layer.gradient_checkpointing == (variant != "plain") for layer in layers)


def test_compiled_layers_under_autocast_round_as_eager_does(device):
    """trainer.compile under bf16 autocast (trainer.mixed_precision): inductor rounds a fused chain to bf16 where eager
    autocast does (`gspo.models.COMPILE_OPTIONS`), so the log-probs are eager's within bf16 noise. Measured on the CPU:
    mean |Δ| 7.9e-5 (8.0e-4 without the option, which this bound of 3e-4 fails), the largest 1.3e-3, the gradients
    within 1.2 % of each parameter's largest entry (2.8 % without). Where inductor ignores the option (the CPU before
    torch 2.13: mean 8.0e-4 with torch 2.11 and 2.12) the bounds are those of code that does not round as eager."""
    rounds = device == "cuda" or CPU_COMPILE_ROUNDS_AS_EAGER
    mean_bound, grad_bound = (3e-4, 0.02) if rounds else (1.2e-3, 0.04)
    model = build_preset("tiny-dense", seed=0)[0].to(device).train()
    traj = ragged_trajectory(model.cpu(), n=8).to(device)
    model.to(device)
    torch._dynamo.reset()
    eager, eager_grads = _logprobs_and_grads(model, traj, compile=False, autocast=True)
    compiled, compiled_grads = _logprobs_and_grads(model, traj, compile=True, autocast=True)
    mask = traj.completion_mask.bool()
    assert (compiled - eager)[mask].abs().mean() <= mean_bound and (compiled - eager)[mask].abs().max() <= 5e-3
    for e, c in zip(eager_grads, compiled_grads, strict=True):
        assert (c - e).abs().max() <= grad_bound * e.abs().max().clamp(min=1e-12)


@pytest.mark.parametrize("head_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-matmul"])
def test_the_fused_head_computes_the_eager_logprobs_entropy_and_gradients(head_dtype):
    """`fused_head` (with trainer.compile): the chunked head's float32 passes compiled, over chunks of three sizes (23
    rows by 5: one dynamic-shape graph per pass), at τ 0.8 with a bias: the eager log-probs and entropy, and every
    gradient within 1e-6 of its largest entry (float32); with a bf16 matmul (the GPU's under autocast) the same,
    within the rounding of the bf16 gradient of the logits."""
    from gspo.logprobs import chunked_token_logprobs, fused_head

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 32, generator=g, requires_grad=True)
    weight = (0.3 * torch.randn(50, 32, generator=g)).requires_grad_()
    bias = (0.1 * torch.randn(50, generator=g)).requires_grad_()
    targets = torch.randint(0, 50, (23,), generator=g)
    upstream = torch.randn(23, generator=g)

    def run(vocab_chunk=None):
        lp, ent = chunked_token_logprobs(hidden, weight, targets, bias, temperature=0.8, chunk_size=5,
                                         with_entropy=True, head_dtype=head_dtype, vocab_chunk=vocab_chunk)
        grads = torch.autograd.grad((lp * upstream).sum(), (hidden, weight, bias))
        return lp.detach(), ent, grads

    torch._dynamo.reset()
    stats = torch._dynamo.utils.counters["stats"]
    captured, graphs = stats["calls_captured"], stats["unique_graphs"]
    eager = run()
    with fused_head():
        fused = run()
    assert stats["calls_captured"] > captured  # compiled, not the eager functions under another name
    assert stats["unique_graphs"] - graphs == 2  # the forward's pass and the backward's, dynamic over the chunks' rows
    with fused_head():  # slices of the vocabulary (16, 16, 16, 2 words): the same graphs, dynamic over widths too
        sliced = run(vocab_chunk=16)
    assert stats["unique_graphs"] - graphs == 2
    tolerance = 1e-6 if head_dtype == torch.float32 else 1e-2
    for got in (fused, sliced):
        torch.testing.assert_close(got[0], eager[0], atol=1e-6 if got is fused else 1e-5, rtol=0)
        torch.testing.assert_close(got[1], eager[1], atol=1e-5, rtol=0)
        for e, c in zip(eager[2], got[2], strict=True):
            assert (c - e).abs().max() <= tolerance * e.abs().max()


def test_prompt_sharing_forwards_run_eager_inside_compiled_layers(device):
    """Rows sharing long prompts (a group): `completion_logprobs` runs each prompt once and its completions against
    its KV cache; given a cache, a compiled layer runs eager (compiled, each layer's index would be a graph of its
    own), so the values are eager's and the layers without a cache are still compiled."""
    model, _ = build_preset("tiny-dense", seed=0)
    model.to(device).train()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, model.config.vocab_size, (2, 24), generator=g).repeat_interleave(4, 0)
    completions = torch.randint(3, model.config.vocab_size, (8, 5), generator=g)
    batch = [t.to(device) for t in (prompts, torch.ones_like(prompts), completions, torch.ones_like(completions))]
    shared, _ = completion_logprobs(model, *batch, trim_padding=True, share_prompts=True)
    torch._dynamo.reset()
    stats = torch._dynamo.utils.counters["stats"]
    before = stats["calls_captured"]
    with compiled_layers(model):
        compiled_shared, _ = completion_logprobs(model, *batch, trim_padding=True, share_prompts=True)
        assert stats["calls_captured"] == before  # nothing compiled: every layer was given a cache
        compiled_plain, _ = completion_logprobs(model, *batch, trim_padding=True, share_prompts=False)
        assert stats["calls_captured"] > before
    assert torch.equal(compiled_shared, shared)  # eager: bit for bit
    assert torch.allclose(compiled_plain, shared, atol=2e-5)


@slow_on_cpu  # the trainer's and the CLI's wiring; the values are the unit tests' above
def test_a_compiled_run_keeps_the_first_minibatch_on_policy_and_trains_like_an_eager_one(tmp_path, monkeypatch):
    """The same run eager and compiled: π_old and π_θ of the on-policy minibatch are the same compiled forwards (its
    ratios are 1 up to float rounding), and the first step's updates see the same log-probs within float rounding,
    over buckets and minibatches of different shapes (compiled as dynamic after the first)."""
    runs, calls = {}, record_objective(monkeypatch, "gspo")
    torch._dynamo.reset()  # compiled from scratch here: a layer compiled by an earlier test would not be captured again
    stats, captured = torch._dynamo.utils.counters["stats"], {}
    for compile in (False, True):
        before, captured_before = len(calls), stats["calls_captured"]
        out = tmp_path / f"compile_{compile}"
        train(load_config(DEMO, tiny_overrides(out, "cold_start=null", "model.name=tiny-dense", "trainer.steps=1",
                                               "rollout.max_new_tokens=12", "rollout.stop=[1, 2, 3, 4]",
                                               "rewards.functions={conftest.varied_reward: 1.0}",
                                               "algorithm.old_logprobs=recompute",
                                               "trainer.eval_every=0", "data.eval_size=1",
                                               f"trainer.compile={str(compile).lower()}")))
        runs[compile] = calls[before:], read_metrics(out / "metrics.jsonl")[0]
        captured[compile] = stats["calls_captured"] - captured_before
    assert captured[False] == 0 and captured[True] > 0  # trainer.compile compiled the learner's forwards, and only it
    (eager_calls, eager_metrics), (compiled_calls, compiled_metrics) = runs[False], runs[True]
    logprobs, old, mask = compiled_calls[0]
    assert (~mask).any()  # ragged completions: trimmed padding under compile too
    assert (logprobs[mask] - old[mask]).abs().max() <= 1e-6
    assert compiled_metrics["clip_frac_tokens_first_mb"] == 0.0
    assert len(compiled_calls) == len(eager_calls) == 4
    for (lp_e, old_e, mask_e), (lp_c, old_c, mask_c) in zip(eager_calls, compiled_calls, strict=True):
        assert torch.equal(mask_e, mask_c)  # the same rollout: sampling is eager in both runs
        assert (lp_c - lp_e)[mask_c].abs().max() <= 1e-4 and (old_c - old_e)[mask_c].abs().max() <= 1e-4
    assert compiled_metrics["loss"] == pytest.approx(eager_metrics["loss"], abs=1e-5)


def test_compile_is_refused_for_moe_models_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"trainer.compile: MoE expert dispatch"):
        train(load_config(DEMO, tiny_overrides(out, "cold_start=null", "trainer.steps=1", "trainer.compile=true")))
    assert not (out / "metrics.jsonl").exists()


@slow_on_cpu  # the trainer's and the CLI's wiring; the values are the unit tests' above
def test_a_compiled_cold_start_takes_the_eager_steps(tmp_path, capsys):
    """`gspo sft --compile` (the cold start's `sft(compile=True)`): the losses of the eager run's steps, within float
    rounding, over batches of different widths."""
    from gspo.cli import main
    from test_cli import last_json

    losses = {}
    torch._dynamo.reset()
    stats = torch._dynamo.utils.counters["stats"]
    before = stats["calls_captured"]
    for flag in ([], ["--compile"]):
        out = tmp_path / f"m{len(flag)}"
        assert main(["sft", "--out", str(out), "--steps", "3", "--batch-size", "4", "--size", "16", "--model",
                     "tiny-dense", *flag]) == 0
        losses[bool(flag)] = last_json(capsys.readouterr().out)["final_loss"]
    assert stats["calls_captured"] > before  # the second run compiled
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
