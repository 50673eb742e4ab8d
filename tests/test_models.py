"""Tests for gspo.models: the character tokenizer, the presets, and save/load round trips (all offline)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, Qwen3ForCausalLM, Qwen3MoeForCausalLM

from gspo.models import (
    DTYPES,
    PRESETS,
    VOCAB_CHARS,
    build_preset,
    build_tokenizer,
    load_model,
    resolve_dtype,
    save_model,
)

TOKENIZER = build_tokenizer()


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=True)["input_ids"]


# ---- tokenizer -------------------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=VOCAB_CHARS, max_size=60))
def test_tokenizer_round_trips_every_vocab_string(text: str) -> None:
    ids = _ids(TOKENIZER, text)
    assert len(ids) == len(text)  # one token per character, nothing added (no BOS/EOS)
    assert TOKENIZER.unk_token_id not in ids
    assert TOKENIZER.decode(ids) == text


def test_tokenizer_specials_and_vocab() -> None:
    tok = TOKENIZER
    assert (tok.pad_token, tok.pad_token_id) == ("<pad>", 0)
    assert (tok.eos_token, tok.eos_token_id) == ("<eos>", 1)
    assert (tok.unk_token, tok.unk_token_id) == ("<unk>", 2)
    assert tok.bos_token is None
    assert tok.padding_side == "left"
    assert len(tok) == 3 + len(VOCAB_CHARS) == 52
    # each vocabulary character has its own id, distinct from the specials
    ids = [_ids(tok, c)[0] for c in VOCAB_CHARS]
    assert sorted(ids) == list(range(3, len(tok)))
    # characters outside the vocabulary become <unk>, one per character
    assert _ids(tok, "A!\n") == [2, 2, 2]
    assert tok.decode([ids[0], 1, 0], skip_special_tokens=True) == VOCAB_CHARS[0]


def test_tokenizer_left_pads() -> None:
    batch = TOKENIZER(["1+2=", "10+20="], padding=True, return_tensors="pt")
    assert batch["input_ids"][0, :2].tolist() == [0, 0]
    assert batch["attention_mask"][0].tolist() == [0, 0, 1, 1, 1, 1]


def test_tokenizer_save_load_identical(tmp_path) -> None:
    TOKENIZER.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "the sum of 12 and 3 is 15. (2*3)-4/5;?: "
    assert _ids(loaded, text) == _ids(TOKENIZER, text)
    assert loaded.get_vocab() == TOKENIZER.get_vocab()
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.unk_token_id) == (0, 1, 2)
    assert loaded.padding_side == "left"
    assert loaded.decode(_ids(loaded, text)) == text


# ---- dtypes ----------------------------------------------------------------------------------------------------------


def test_resolve_dtype() -> None:
    for name, dtype in DTYPES.items():
        assert resolve_dtype(name) is dtype
        assert resolve_dtype(dtype) is dtype
    with pytest.raises(ValueError, match=r"'fp33'.*bfloat16"):
        resolve_dtype("fp33")
    with pytest.raises(ValueError, match="int8"):
        resolve_dtype(torch.int8)


def test_resolve_dtype_is_the_one_parser_of_dtype_names() -> None:
    """Aliases, "torch."-prefixed and upper-case names (what the rollout engine and mixed precision accept too); every
    non-floating dtype or unknown name is a ValueError saying a floating-point dtype was expected."""
    for name, dtype in [("bf16", torch.bfloat16), ("fp16", torch.float16), ("half", torch.float16),
                        ("fp32", torch.float32), ("torch.float32", torch.float32), ("torch.bfloat16", torch.bfloat16),
                        ("BF16", torch.bfloat16), ("float64", torch.float64)]:
        assert resolve_dtype(name) is dtype
    assert resolve_dtype(torch.float64) is torch.float64
    for bad in ["int8", "notadtype", "torch.save", "", torch.int32, torch.bool, None, 16]:
        with pytest.raises(ValueError, match="floating-point"):
            resolve_dtype(bad)


# ---- presets ---------------------------------------------------------------------------------------------------------


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_deterministic_from_seed_and_forward(name: str) -> None:
    rng_before = torch.get_rng_state()
    model_a, tok = build_preset(name, seed=3)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the caller's RNG is left alone
    model_b, _ = build_preset(name, seed=3)
    model_c, _ = build_preset(name, seed=4)
    a, b, c = _state(model_a), _state(model_b), _state(model_c)
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)

    cfg = model_a.config
    assert cfg.vocab_size == len(tok)
    assert (cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id) == (0, 1, None)
    assert cfg.use_cache and cfg.tie_word_embeddings
    assert model_a.get_output_embeddings().weight is model_a.get_input_embeddings().weight
    assert cfg._attn_implementation in ("sdpa", "eager")

    ids = torch.tensor([_ids(tok, "12+34="), _ids(tok, "9+990=")])
    logits = model_a(input_ids=ids).logits
    assert logits.shape == (2, 6, len(tok))
    assert torch.isfinite(logits).all()


def test_tiny_moe_is_a_top2_moe_with_8_experts() -> None:
    model, _ = build_preset("tiny-moe")
    assert isinstance(model, Qwen3MoeForCausalLM)
    assert model.config.num_experts == 8
    assert model.config.num_experts_per_tok == 2
    assert model.config.norm_topk_prob
    n_params = sum(p.numel() for p in model.parameters())
    assert 1.5e6 < n_params < 2.1e6
    # the routed MLP really exists: every layer has a router producing one logit per expert
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    assert len(routers) == model.config.num_hidden_layers
    assert all(r.weight.shape[0] == 8 for r in routers)


def test_tiny_dense_is_dense() -> None:
    model, _ = build_preset("tiny-dense")
    assert isinstance(model, Qwen3ForCausalLM)
    assert model.config.intermediate_size == 512
    assert not any(n.endswith("mlp.gate") for n, _ in model.named_modules())


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match="tiny-moe"):
        build_preset("tiny-moo")


def test_load_model_preset_matches_build_preset() -> None:
    model, tok = load_model("tiny-moe", seed=5)
    ref, _ = build_preset("tiny-moe", seed=5)
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in model.state_dict().items())
    assert tok.pad_token_id == 0


# ---- save / load -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_save_then_load_gives_identical_logits(tmp_path, name: str) -> None:
    model, tok = build_preset(name, seed=1)
    out = save_model(model, tok, tmp_path / "ckpt")
    assert (out / "model.safetensors").is_file()
    assert (out / "config.json").is_file()

    loaded, loaded_tok = load_model(str(out))
    assert type(loaded) is type(model)
    batch = tok(["123+456=579", "3,7,25:46=", "the end"], padding=True, return_tensors="pt")
    model.eval()
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, loaded(**batch).logits)
    assert _ids(loaded_tok, "the 12 (x)") == _ids(tok, "the 12 (x)")
    assert loaded_tok.padding_side == "left"
    assert loaded_tok.pad_token_id == 0


def test_load_model_bfloat16(tmp_path) -> None:
    model, tok = build_preset("tiny-dense", seed=2)
    save_model(model, tok, tmp_path)
    loaded, _ = load_model(str(tmp_path), dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    assert torch.equal(loaded.get_input_embeddings().weight, model.get_input_embeddings().weight.to(torch.bfloat16))
    logits = loaded(input_ids=torch.tensor([_ids(tok, "1+1=")])).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    preset_bf16, _ = build_preset("tiny-dense", seed=2, dtype=torch.bfloat16)
    assert next(preset_bf16.parameters()).dtype == torch.bfloat16


def test_attention_implementation_is_chosen_at_load_and_gives_the_same_log_probs(tmp_path) -> None:
    """model.attn_implementation: eager and sdpa compute the same log-probs of left-padded prompts (the masks and
    positions agree), for a saved folder and a preset; an unknown or unavailable kernel is refused at load, naming
    the key."""
    from gspo.logprobs import completion_logprobs

    model, tok = build_preset("tiny-moe", seed=3)
    save_model(model, tok, tmp_path)
    prompts = tok(["12+34=", "5+6="], padding=True, return_tensors="pt")
    completion = torch.tensor([[_ids(tok, "4")[0], _ids(tok, "6")[0], 1], [_ids(tok, "1")[0], 1, 0]])
    c_mask = (torch.arange(3) < torch.tensor([[3], [2]])).long()
    results = {}
    for impl in ("sdpa", "eager"):
        for name in (str(tmp_path), "tiny-moe"):
            loaded, _ = load_model(name, seed=3, attn_implementation=impl)
            assert loaded.config._attn_implementation == impl
            with torch.no_grad():
                results[impl, name] = completion_logprobs(loaded.eval(), prompts.input_ids, prompts.attention_mask,
                                                          completion, c_mask)[0]
    reference = results["sdpa", str(tmp_path)]
    assert all(torch.allclose(lp, reference, atol=1e-5) for lp in results.values())
    assert load_model(str(tmp_path))[0].config._attn_implementation == "sdpa"  # None: the model's default
    with pytest.raises(ValueError, match=r"model.attn_implementation='bogus' cannot be used .* not supported"):
        load_model(str(tmp_path), attn_implementation="bogus")
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(ValueError, match=r"flash_attention_2.*(?i:not be installed|n't seem to be installed)"):
            load_model("tiny-dense", attn_implementation="flash_attention_2")


def test_load_model_missing_dir(tmp_path) -> None:
    missing = tmp_path / "does-not-exist"
    with pytest.raises(FileNotFoundError, match=r"does-not-exist.*does not exist"):
        load_model(str(missing))
    # a relative path is reported as written, never tried as a hub id
    with pytest.raises(FileNotFoundError, match=r"'\./runs/nowhere/ckpt' does not exist"):
        load_model("./runs/nowhere/ckpt")


def test_load_model_on_a_file(tmp_path) -> None:
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"model\.bin' is a file"):
        load_model(str(tmp_path / "model.bin"))


def test_load_model_empty_dir(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=f"{tmp_path.name}.*no config.json"):
        load_model(str(tmp_path))


def test_load_model_config_without_weights(tmp_path) -> None:
    model, tok = build_preset("tiny-dense")
    save_model(model, tok, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_model(str(tmp_path))


def test_load_model_refuses_a_checkpoint_missing_weights(tmp_path) -> None:
    """transformers initialises weights a checkpoint lacks at random and only reports it: the run trained from a
    random layer (e.g. an untied model saved without lm_head.weight) without an error."""
    from safetensors.torch import load_file, save_file
    model, tok = build_preset("tiny-dense")
    save_model(model, tok, tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.0.mlp.down_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no weights for \['model.layers.0.mlp.down_proj.weight'\]"):
        load_model(str(tmp_path))


def test_load_model_unreadable_config(tmp_path) -> None:
    model, tok = build_preset("tiny-dense")
    save_model(model, tok, tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"unreadable config.json"):
        load_model(str(tmp_path))


def test_load_model_without_tokenizer(tmp_path) -> None:
    model, tok = build_preset("tiny-dense")
    save_model(model, tok, tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / f).unlink(missing_ok=True)
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        load_model(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="could not load a tokenizer"):
        load_model(str(tmp_path))


def test_load_model_sets_missing_pad_to_eos(tmp_path) -> None:
    model, tok = build_preset("tiny-dense")
    save_model(model, tok, tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("pad_token", None)
    cfg_path.write_text(json.dumps(cfg))
    _, loaded_tok = load_model(str(tmp_path))
    assert loaded_tok.pad_token == "<eos>"
    assert loaded_tok.pad_token_id == 1


def test_load_model_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        load_model("")
    with pytest.raises(ValueError, match="dtype"):
        load_model("tiny-moe", dtype="float8")


# ---- unreadable, corrupt and unsafe model directories ----------------------------------------------------------------


class _Payload:
    """Unpickling this creates `marker`: proof that a pickle was executed."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (type(self.marker).touch, (self.marker,))


@pytest.fixture
def saved(tmp_path):
    model, tok = build_preset("tiny-dense")
    save_model(model, tok, tmp_path / "model")
    return tmp_path / "model"


def test_load_model_corrupt_safetensors_names_the_directory(saved) -> None:
    (saved / "model.safetensors").write_bytes(b"\x00garbage" * 64)
    with pytest.raises(ValueError, match=rf"could not load model weights from model directory '{saved}'"):
        load_model(str(saved))


def test_load_model_refuses_pickle_only_weights_without_unpickling(saved, tmp_path) -> None:
    marker = tmp_path / "unpickled"
    torch.save({"weights": _Payload(marker)}, saved / "pytorch_model.bin")
    (saved / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"holds only pickle weights \(pytorch_model\.bin\); gspo loads safetensors"):
        load_model(str(saved))
    assert not marker.exists()


def test_load_model_reads_safetensors_only(saved, monkeypatch) -> None:
    import gspo.models as models

    calls = []
    real = models.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", spy)
    load_model(str(saved))
    assert calls and calls[0]["use_safetensors"] is True and calls[0]["trust_remote_code"] is False


@pytest.mark.skipif(not hasattr(os, "seteuid"), reason="POSIX only")
def test_load_model_permission_denied_names_what_cannot_be_read(tmp_path) -> None:
    """Root reads everything, so as root the check runs with the effective uid of `nobody` for the duration."""
    folder = Path(tempfile.mkdtemp(prefix="gspo-test-perm-"))  # a world-traversable place, unlike pytest's tmp_path
    try:
        folder.chmod(0o755)
        model, tok = build_preset("tiny-dense")
        save_model(model, tok, folder / "model")
        (folder / "model").chmod(0o700)
        with as_unprivileged(), pytest.raises(PermissionError, match=r"model directory '.*model' cannot be read"):
            load_model(str(folder / "model"))
        (folder / "model").chmod(0o755)
        (folder / "model" / "config.json").chmod(0o600)
        with as_unprivileged(), pytest.raises(PermissionError, match=r"config\.json in model directory .* cannot be"):
            load_model(str(folder / "model"))
    finally:
        shutil.rmtree(folder)


@contextlib.contextmanager
def as_unprivileged():
    """Run the block with the effective uid of `nobody` when we are root (permissions do not apply to root)."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


@pytest.mark.parametrize("family", ["mixtral", "gpt2"])
def test_disable_dropout_makes_train_mode_forwards_deterministic(family) -> None:
    """Mixtral with attention dropout and router jitter, GPT-2 with its dropout modules: two train-mode forwards
    differ, and after `disable_dropout` (which lists what it turned off) they are equal, and equal to eval mode."""
    import transformers

    from gspo.models import disable_dropout

    if family == "mixtral":
        config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                            num_experts_per_tok=2, attention_dropout=0.3, router_jitter_noise=0.5)
        expected = {"attention_dropout: 0.3", "jitter_noise: 0.5"}
    else:
        config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)
        expected = {": 0.1"}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(0, 64, (2, 12))
    assert not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
    assert disable_dropout(model, dry_run=True) and not torch.equal(model(input_ids=ids).logits,
                                                                    model(input_ids=ids).logits)  # dry run: listed
    found = disable_dropout(model)
    assert all(any(f.endswith(e) for f in found) for e in expected), found
    train = model(input_ids=ids).logits
    assert torch.equal(train, model(input_ids=ids).logits)
    torch.testing.assert_close(train, model.eval()(input_ids=ids).logits)
    assert disable_dropout(model) == []


def test_a_tokenizer_larger_than_the_models_embedding_table_is_refused(tmp_path) -> None:
    """Another model's tokenizer files copied into a model folder: its ids past the embedding table made a silent 0 %
    accuracy on digit prompts (ids that happen to fit) and an IndexError deep in torch on others."""
    model, tokenizer = build_preset("tiny-dense")
    save_model(model, tokenizer, tmp_path / "m")
    larger = build_tokenizer()
    larger.add_tokens([f"<extra_{i}>" for i in range(20)])
    larger.save_pretrained(tmp_path / "m")
    rows = model.get_input_embeddings().num_embeddings
    with pytest.raises(ValueError, match=rf"has {len(larger)} tokens but the model's embedding table has {rows} rows"):
        load_model(str(tmp_path / "m"))
