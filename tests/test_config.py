"""The run configuration: YAML + dotted overrides, validated (unknown keys, bad values, incompatible options) with
errors that name the offending key, before any compute."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from conftest import DEMO
from gspo.config import (
    Config,
    ConfigError,
    apply_overrides,
    config_diff,
    config_to_dict,
    load_config,
    validate_config,
)
from gspo.runfolder import check_resume_config


def test_demo_config_validates():
    cfg = load_config(DEMO)
    assert isinstance(cfg, Config)
    assert cfg.model.name == "tiny-moe"
    assert cfg.algorithm.loss == "gspo"
    assert cfg.algorithm.minibatches == 4
    assert (cfg.algorithm.eps_low, cfg.algorithm.eps_high) == (3e-4, 4e-4)  # the paper's objective and ε
    assert cfg.cold_start is not None  # builds its own cold-start model: runnable with no other file
    assert cfg.data.task == "addition"
    assert (cfg.rollout.prompts_per_step * cfg.rollout.group_size) % cfg.algorithm.minibatches == 0


def test_defaults_without_a_file_validate():
    cfg = load_config(None)
    assert cfg.cold_start is None
    assert cfg.algorithm.loss == "gspo"


def test_validated_config_round_trips_through_its_saved_yaml():
    """OUT/config.yaml is what a resume compares against: it must re-validate to the same config."""
    cfg = load_config(DEMO, ["algorithm.loss=dr_grpo", "optim.lr=1e-3"])
    saved = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
    again = validate_config(yaml.safe_load(saved))
    assert again == cfg
    assert config_diff(config_to_dict(again), config_to_dict(cfg)) == []


def _saved(cfg: Config, tmp_path) -> Path:
    """`cfg` saved as a run saves it (OUT/config.yaml)."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    return path


@pytest.mark.parametrize(("loss", "low", "high", "scale"),
                         [("grpo", 0.2, 0.27, "group"), ("cispo", 1.0, 0.28, "group"), ("dr_grpo", 0.2, 0.27, "none")])
def test_a_saved_config_with_another_loss_takes_that_losss_defaults(tmp_path, loss, low, high, scale):
    """A run's config.yaml reused with another algorithm.loss (`gspo train RUN/config.yaml algorithm.loss=grpo`,
    `gspo compare --config RUN/config.yaml`) runs it at its own eps and advantage scale, not the saved GSPO ones
    (they were saved as set, 3e-4 / 4e-4: GRPO trained at GSPO's clip range, dr_grpo was refused)."""
    saved = _saved(load_config(DEMO), tmp_path)
    algo = load_config(saved, [f"algorithm.loss={loss}"]).algorithm
    assert (algo.eps_low, algo.eps_high, algo.advantage_scale) == (pytest.approx(low), pytest.approx(high), scale)
    assert load_config(saved) == load_config(DEMO)  # and as it was, without the override


def test_a_saved_config_keeps_the_keys_the_user_set(tmp_path):
    saved = _saved(load_config(DEMO, ["algorithm.eps_high=0.5", "rewards.accuracy_reward=addition"]), tmp_path)
    cfg = load_config(saved, ["algorithm.loss=grpo", "trainer.steps=null", "trainer.epochs=2"])
    assert (cfg.algorithm.eps_low, cfg.algorithm.eps_high) == (pytest.approx(0.2), 0.5)
    assert cfg.rewards.accuracy_reward == "addition" and cfg.trainer.epochs == 2
    derived = yaml.safe_load(_saved(load_config(None), tmp_path).read_text())  # nothing set: the defaults derive
    assert derived["trainer"]["steps"] is None and derived["rewards"]["accuracy_reward"] is None
    cfg = load_config(tmp_path / "config.yaml", ["trainer.epochs=2", "rewards.functions={math: 1}"])
    assert cfg.trainer.steps is None and cfg.rewards.accuracy_reward == "math"
    assert config_to_dict(load_config(None), resolved=True)["algorithm"]["eps_low"] == pytest.approx(3e-4)


def test_resume_compares_the_configs_as_resolved(tmp_path):
    """A run saved with its eps derived (null) or, before they were, as values, resumes with the same settings given
    either way; another loss is still refused."""
    cfg = load_config(DEMO)
    old = cfg.model_dump(mode="json")  # what a run saved before derived keys were saved as null
    for saved in (config_to_dict(cfg), old):
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
        assert check_resume_config(tmp_path, config_to_dict(cfg)) == []
        assert check_resume_config(tmp_path, config_to_dict(load_config(DEMO, ["algorithm.eps_low=3e-4"]))) == []
        with pytest.raises(ConfigError, match=r"differs in algorithm\.eps_high, algorithm\.eps_low, algorithm\.loss"):
            check_resume_config(tmp_path, config_to_dict(load_config(DEMO, ["algorithm.loss=grpo"])))


@pytest.mark.parametrize(
    ("loss", "low", "high"),
    [("gspo", 3e-4, 4e-4), ("gspo_token", 3e-4, 4e-4), ("grpo", 0.2, 0.27), ("dapo", 0.2, 0.28), ("cispo", 1.0, 0.28)],
)
def test_eps_defaults_resolve_per_loss(loss, low, high):
    cfg = load_config(DEMO, [f"algorithm.loss={loss}"])
    assert cfg.algorithm.eps_low == pytest.approx(low)
    assert cfg.algorithm.eps_high == pytest.approx(high)
    assert cfg.algorithm.advantage_scale == "group"


def test_explicit_eps_wins_over_the_default():
    cfg = load_config(DEMO, ["algorithm.loss=grpo", "algorithm.eps_high=0.3"])
    assert cfg.algorithm.eps_low == pytest.approx(0.2)
    assert cfg.algorithm.eps_high == pytest.approx(0.3)


def test_dr_grpo_defaults_to_no_std_scaling():
    cfg = load_config(DEMO, ["algorithm.loss=dr_grpo"])
    assert cfg.algorithm.advantage_scale == "none"


def test_a_disallowed_advantage_scale_says_what_to_set_and_why():
    """The rule and its message come from the objective's registry entry (allowed_scales, summary)."""
    with pytest.raises(ConfigError, match=r"algorithm\.loss dr_grpo requires algorithm\.advantage_scale 'none', got "
                                          r"'batch' \(.*no std normalisation of the advantages\)"):
        load_config(DEMO, ["algorithm.loss=dr_grpo", "algorithm.advantage_scale=batch"])


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("lossx=1", "lossx"),
        ("algorithm.lossx=1", "algorithm.lossx"),
        ("trainer.stpes=3", "trainer.stpes"),
        ("rollout.temprature=0.5", "rollout.temprature"),
    ],
)
def test_unknown_key_is_an_error_naming_the_dotted_key(override, key):
    with pytest.raises(ConfigError) as info:
        load_config(DEMO, [override])
    assert f"{key}: unknown key" in str(info.value)


@pytest.mark.parametrize(
    ("override", "hint"),
    [("rollout.groupsize=4", "rollout.groupsize: unknown key (did you mean 'group_size'?)"),
     ("rolout.group_size=4", "rolout: unknown key (did you mean 'rollout'?)"),
     ("trainer.guard.windw=3", "trainer.guard.windw: unknown key (did you mean 'window'?)"),
     ("optim.learning_rate=1e-5", "optim.learning_rate: unknown key (optim takes: lr, weight_decay, betas,")],
)
def test_an_unknown_key_suggests_the_close_ones_or_lists_the_sections_keys(override, hint):
    with pytest.raises(ConfigError) as info:
        load_config(DEMO, [override])
    assert hint in str(info.value)


def test_unknown_key_in_the_yaml_file_is_an_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  loss: gspo\n  minibatch: 2\n")
    with pytest.raises(ConfigError, match=r"algorithm\.minibatch: unknown key"):
        load_config(path)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("algorithm.old_logprobs=foo", "algorithm.old_logprobs"),
        ("rollout.group_size=1", "rollout.group_size"),
        ("algorithm.loss=ppo", "algorithm.loss"),
        ("optim.lr=0", "optim.lr"),
        ("optim.lr=abc", "optim.lr"),
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("model.dtype=float64", "model.dtype"),
        ("trainer.steps=0", "trainer.steps"),
        ("trainer.seed=-1", "trainer.seed"),  # set_seed would reject it only after the run folder was created
        ("rewards.on_error=ignore", "rewards.on_error"),
        ("rewards.timeout_s=0", "rewards.timeout_s"),
        ("rewards.timeout_s=.inf", "rewards.timeout_s"),
        ("optim.lr=.inf", "optim.lr"),  # trained a model of NaN weights to "completed"
        ("optim.weight_decay=.inf", "optim.weight_decay"),
        ("cold_start.lr=.nan", "cold_start.lr"),
        ("rollout.temperature=.inf", "rollout.temperature"),
        ("algorithm.kl_beta=.inf", "algorithm.kl_beta"),
        ("rollout.stop=['']", "rollout.stop"),  # would end every completion before its first token
        ("rewards.functions={addition: 0}", "rewards.functions"),  # every advantage 0: nothing trains
        ("rewards.workers=0", "rewards.workers"),
        ("data.max_prompt_tokens=0", "data.max_prompt_tokens"),
        ("trainer.max_bad_steps=0", "trainer.max_bad_steps"),
        ("trainer.steps=2.5", "trainer.steps"),  # a fractional number for an int
        ("rollout.stop=abc", "rollout.stop"),  # a string for a list
        ("model=3", "model"),  # a number for a section
        ("optim.betas=[0.9]", "optim.betas"),  # a tuple of the wrong length
        ("optim.betas=[1.5, 0.9]", "optim.betas.0"),  # torch refused it only once the optimizer was built
        ("optim.betas=[0.9, 1.0]", "optim.betas.1"),
        ("trainer.micro_batch_tokens=0", "trainer.micro_batch_tokens"),
        ("rollout.max_batch_rows=0", "rollout.max_batch_rows"),
    ],
)
def test_bad_value_is_an_error_naming_the_key(override, key):
    with pytest.raises(ConfigError) as info:
        load_config(DEMO, [override])
    assert key in str(info.value)


def test_all_errors_are_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load_config(DEMO, ["rollout.group_size=1", "optim.lr=-1", "trainer.bogus=1"])
    message = str(info.value)
    assert "rollout.group_size" in message and "optim.lr" in message and "trainer.bogus" in message


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["algorithm.loss=dr_grpo", "algorithm.advantage_scale=group"], ["dr_grpo", "advantage_scale"]),
        (["algorithm.old_logprobs=rollout", "rollout.top_p=0.9"], ["old_logprobs=rollout", "top_p"]),
        (["algorithm.old_logprobs=rollout", "rollout.top_k=5"], ["old_logprobs=rollout", "top_k"]),
        (["rollout.prompts_per_step=3", "rollout.group_size=3"], ["algorithm.minibatches=4", "9 completions"]),
        (["data.path=train.jsonl"], ["data.task", "data.path"]),  # both (the demo sets data.task)
        (["data.task=null"], ["data.task", "data.path"]),  # neither
        (["rollout.max_batch_rows=7", "rollout.group_size=8"], ["max_batch_rows=7", "one group"]),
        # an evaluation group of 16 under a cap of 8 rows recursed until RecursionError at the first evaluation
        (["rollout.max_batch_rows=8", "trainer.eval_samples=16"], ["eval_samples=16", "max_batch_rows=8"]),
        (["rollout.max_batch_rows=64", "rollout.engine=vllm"], ["max_batch_rows", "max_num_seqs"]),
        # the cache release is for the built-in engine's compiled loop, between a sync run's rollouts and updates
        (["rollout.release_decode_cache=true", "rollout.decode=dynamic"], ["release_decode_cache", "decode=dynamic"]),
        (["rollout.release_decode_cache=true", "rollout.engine=vllm"], ["release_decode_cache", "engine=vllm"]),
        (["rollout.release_decode_cache=true", "rollout.mode=async"], ["release_decode_cache", "mode=async"]),
        # settings that cannot take effect were accepted and unused (as async-only keys in a sync run are not)
        (["rollout.dynamic_max_rounds=10"], ["rollout.dynamic_max_rounds=10", "dynamic_sampling=true"]),
        (["rewards.overlong_penalty=5"], ["rewards.overlong_penalty=5", "without rewards.overlong_buffer"]),
        (["trainer.eval_temperature=0.5"], ["trainer.eval_temperature=0.5", "eval_samples=1", "greedily"]),
    ],
)
def test_incompatible_options_raise(overrides, names):
    with pytest.raises(ConfigError) as info:
        load_config(DEMO, overrides)
    for name in names:
        assert name in str(info.value)


def test_compatible_variants_of_those_options_validate():
    load_config(DEMO, ["algorithm.loss=dr_grpo", "algorithm.advantage_scale=none"])
    load_config(DEMO, ["algorithm.old_logprobs=recompute", "rollout.top_p=0.9"])
    load_config(DEMO, ["rollout.prompts_per_step=3", "rollout.group_size=4", "algorithm.minibatches=3"])
    load_config(DEMO, ["rollout.max_batch_rows=8", "rollout.group_size=8", "trainer.micro_batch_tokens=4096"])
    load_config(DEMO, ["rollout.release_decode_cache=true"])  # decode auto: compiled on CUDA
    load_config(DEMO, ["rollout.dynamic_sampling=true", "rollout.dynamic_max_rounds=10"])
    load_config(DEMO, ["rewards.overlong_buffer=4", "rewards.overlong_penalty=5"])
    load_config(DEMO, ["trainer.eval_samples=4", "trainer.eval_temperature=0.5"])
    cfg = load_config(DEMO, ["data.task=null", "data.path=train.jsonl", "data.fields={solution: answer}"])
    assert cfg.data.fields == {"solution": "answer"}


def test_overrides_parse_yaml_values():
    cfg = load_config(DEMO, [
        "trainer.steps=7",
        "optim.lr=1e-3",
        "algorithm.kl_beta=2.5E-2",
        "optim.grad_clip=null",
        "log.progress=false",
        "rollout.stop=[';', '.']",
        "optim.betas=[0.8, 0.95]",
        "rewards.functions={addition: 2}",
        "data.task_options.digits=3",
        "trainer.out=2024",  # a number where a string is expected (a folder name) is taken as that string
    ])
    assert cfg.trainer.steps == 7 and isinstance(cfg.trainer.steps, int)
    assert cfg.optim.lr == 1e-3
    assert cfg.algorithm.kl_beta == 2.5e-2
    assert cfg.optim.grad_clip is None
    assert cfg.log.progress is False
    assert cfg.rollout.stop == [";", "."]
    assert cfg.optim.betas == (0.8, 0.95)
    assert cfg.rewards.functions == {"addition": 2.0}
    assert cfg.data.task_options == {"digits": 3}
    assert cfg.trainer.out == "2024"


@pytest.mark.parametrize(
    ("override", "key", "value"),
    [("trainer.out=007", "trainer.out", "007"), ("trainer.out=2024_01", "trainer.out", "2024_01"),
     ("trainer.out=12:30", "trainer.out", "12:30"), ("trainer.out=1.10", "trainer.out", "1.10"),
     ("trainer.out=runs/exp #2", "trainer.out", "runs/exp #2"),
     ("data.system_prompt=#1 rule: answer with a number", "data.system_prompt", "#1 rule: answer with a number"),
     ("data.prompt_template=Solve: {question}", "data.prompt_template", "Solve: {question}"),
     ("data.eval_split=2024-01-01", "data.eval_split", "2024-01-01"),
     ("data.fields.prompt=007", "data.fields", {"prompt": "007"}),
     ("trainer.out='quoted'", "trainer.out", "quoted"),  # YAML's quotes still read
     ("data.eval_split=null", "data.eval_split", None), ("model.attn_implementation=~", "model.attn_implementation",
                                                         None)],
)
def test_an_override_of_a_string_key_keeps_its_text(override, key, value):
    """YAML would read `007` as 7, `12:30` as 750 (sexagesimal), cut `runs/exp #2` at its comment, drop `#1 rule`
    as a comment (null), and take `Solve: {question}` for a mapping; a key that takes a string gets the text."""
    section, name = key.split(".")
    assert getattr(getattr(load_config(DEMO, [override]), section), name) == value


def test_an_override_of_a_key_that_takes_strings_or_a_list_reads_a_list():
    cfg = load_config(None, ["data.task=null", "data.path=[a.jsonl, b.jsonl]", "data.eval_path=c #2.jsonl"])
    assert cfg.data.path == ["a.jsonl", "b.jsonl"] and cfg.data.eval_path == "c #2.jsonl"


def test_apply_overrides_types_untyped_values():
    """Values in free-form dicts (task_options, wandb) keep their YAML type: `1e-3` is a float, not the text '1e-3'."""
    data = apply_overrides({}, ["a.f=1e-3", "a.g=-2E+4", "a.i=10", "a.b=true", "a.s=hello", "a.l=[1, x]", "a.n=null"])
    assert data == {"a": {"f": 1e-3, "g": -2e4, "i": 10, "b": True, "s": "hello", "l": [1, "x"], "n": None}}
    assert isinstance(data["a"]["f"], float)


def test_yaml_file_reads_exponent_floats(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  task: addition\n  task_options: {digits: 2}\noptim:\n  lr: 5e-4\n")
    cfg = load_config(path)
    assert cfg.optim.lr == 5e-4


def test_later_override_wins_and_an_empty_section_can_be_filled():
    cfg = load_config(DEMO, ["trainer.steps=3", "trainer.steps=5", "cold_start=null"])
    assert cfg.trainer.steps == 5 and cfg.cold_start is None
    cfg = load_config(DEMO, ["cold_start=null", "cold_start.steps=4", "log.wandb=null", "log.wandb.project=p"])
    assert cfg.cold_start is not None and cfg.cold_start.steps == 4
    assert cfg.log.wandb == {"project": "p"}


@pytest.mark.parametrize("override", ["foo", "=3", "trainer.steps"])
def test_malformed_override_errors(override):
    with pytest.raises(ConfigError, match=r"section\.key=value"):
        load_config(DEMO, [override])


def test_override_into_a_scalar_is_an_error():
    with pytest.raises(ConfigError, match="not a section"):
        load_config(DEMO, ["trainer.steps.x=1"])


def test_yaml_merge_keys_are_read_and_duplicates_still_refused(tmp_path):
    """`<<: *anchor` (which yaml.safe_load reads) was refused: 'could not determine a constructor for the tag
    tag:yaml.org,2002:merge'. The mapping's own keys win over merged ones, as in YAML; a repeated key is still an
    error."""
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  guard:\n    <<: {window: 30, warmup: 15, patience: 2}\n    patience: 4\n")
    guard = load_config(path).trainer.guard
    assert (guard.window, guard.warmup, guard.patience) == (30, 15, 4)
    path.write_text("trainer:\n  guard:\n    <<: {window: 30}\n    patience: 4\n    patience: 5\n")
    with pytest.raises(ConfigError, match="duplicate key 'patience'"):
        load_config(path)


def test_missing_or_non_mapping_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path)
    path = tmp_path / "bad.yaml"
    path.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


def test_an_empty_config_file_is_refused_not_trained_as_the_defaults(tmp_path):
    """A config file that sets nothing (empty, or comments only: a failed save, the wrong file) trained the built-in
    tiny addition demo as if it were the user's run; an explicit `{}` still means the defaults."""
    path = tmp_path / "mine.yaml"
    for text in ("", "# my run\n\n"):
        path.write_text(text)
        with pytest.raises(ConfigError, match=r"mine\.yaml is empty: it sets nothing.*gspo demo"):
            load_config(path)
    path.write_text("{}\n")
    assert load_config(path) == load_config(None)


def test_a_flow_mapping_without_a_space_after_its_colon_says_how_to_write_it(tmp_path):
    """YAML reads `{last_number:1.0}` as one key "last_number:1.0" with no value; the error said only "Input should
    be a valid number (got None)"."""
    want = r"YAML reads 'last_number:1\.0' as one key with no value: write 'last_number: 1\.0'"
    with pytest.raises(ConfigError, match=want):
        load_config(None, ["rewards.functions={last_number:1.0}"])
    path = tmp_path / "c.yaml"
    path.write_text("rewards:\n  functions: {last_number:1.0}\n")
    with pytest.raises(ConfigError, match=want):
        load_config(path)


def test_config_diff_finds_differing_dotted_keys():
    a = config_to_dict(load_config(DEMO))
    b = config_to_dict(load_config(DEMO, ["optim.lr=2e-3", "rollout.group_size=4", "data.task_options.digits=3"]))
    assert config_diff(a, b) == ["data.task_options.digits", "optim.lr", "rollout.group_size"]
    assert config_diff(a, a) == []
    assert config_diff({"x": {"y": 1}}, {"x": {"y": 1, "z": 2}, "w": 0}) == ["w", "x.z"]
    assert config_diff({"x": {"y": 1}}, {"x": None}) == ["x"]


@pytest.mark.parametrize(
    ("override", "key"),
    [("trainer.eval_every=on", "trainer.eval_every"), ("trainer.steps=true", "trainer.steps"),
     ("optim.lr=yes", "optim.lr"), ("trainer.threads=false", "trainer.threads"), ("cold_start=true", "cold_start"),
     ("rewards.timeout_s=off", "rewards.timeout_s")],
)
def test_a_boolean_is_not_a_number(override, key):
    """YAML reads on/off/yes/no as booleans, which pydantic would take as 1/0 for a number field."""
    with pytest.raises(ConfigError, match=rf"{key}: got the boolean (true|false), which this key does not take"):
        load_config(DEMO, [override])


@pytest.mark.parametrize(
    ("override", "key", "where"),
    [("optim.betas=[no, 0.999]", "optim.betas", "false at [0]"),
     ("rewards.functions={addition: 1, math: off}", "rewards.functions", "false at ['math']"),
     ("rewards.functions={addition: yes}", "rewards.functions", "true at ['addition']"),
     ("rollout.stop=[yes]", "rollout.stop", "true at [0]")],
)
def test_a_boolean_is_not_a_number_inside_a_list_or_dict(override, key, where):
    """`betas: [no, 0.999]` was (0.0, 0.999), `functions: {math: off}` a weight of 0."""
    with pytest.raises(ConfigError, match=rf"{key}: got the boolean {re.escape(where)}, which this key does not take"):
        load_config(DEMO, [override, "rewards.accuracy_reward=addition"])


def test_booleans_stay_valid_where_a_key_takes_one():
    cfg = load_config(DEMO, ["log.progress=no", "model.trust_remote_code=false", "data.task_options={digits: 2}"])
    assert cfg.log.progress is False and cfg.model.trust_remote_code is False
    cfg = load_config(DEMO, ["data.chat_template_kwargs={enable_thinking: false}", "log.wandb={save_code: true}",
                             "rollout.vllm.engine_args={enable_chunked_prefill: false}"])
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False} and cfg.log.wandb == {"save_code": True}


def test_reliability_defaults():
    cfg = load_config(None)
    assert cfg.rewards.timeout_s == 30.0 and cfg.rewards.workers == 1  # per batch of calls
    assert cfg.data.max_prompt_tokens is None and cfg.trainer.max_bad_steps == 5
    cfg = load_config(None, ["rewards.timeout_s=null", "trainer.max_bad_steps=null", "data.max_prompt_tokens=64"])
    assert cfg.rewards.timeout_s is None and cfg.trainer.max_bad_steps is None and cfg.data.max_prompt_tokens == 64


# ------------------------------------------------------------------------------- routing replay: config vs training


def test_routing_replay_rules_of_the_config_alone_are_checked_by_validation():
    """The pure config rules stay in validation: r2 needs old_logprobs=recompute, replay excludes gradient
    checkpointing, and the mode must be one of the known ones."""
    assert load_config(DEMO, ["algorithm.routing_replay=r2"]).algorithm.routing_replay == "r2"
    with pytest.raises(ConfigError, match="use old_logprobs=recompute"):
        load_config(DEMO, ["algorithm.routing_replay=r2", "algorithm.old_logprobs=rollout"])
    with pytest.raises(ConfigError, match=r"routing_replay=r2 .*gradient_checkpointing"):
        load_config(DEMO, ["algorithm.routing_replay=r2", "trainer.gradient_checkpointing=true"])
    with pytest.raises(ConfigError, match="routing_replay"):
        load_config(DEMO, ["algorithm.routing_replay=r4"])


def test_config_validation_builds_no_model(monkeypatch):
    """Whether the model can replay its routing needs the model (on the meta device): validation does not ask, so a
    dense preset with routing replay validates; training start refuses it (next test)."""
    import transformers

    built = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config",
                        lambda *a, **k: built.append(a) or pytest.fail("config validation built a model"))
    cfg = load_config(DEMO, ["algorithm.routing_replay=r3", "model.name=tiny-dense"])
    assert cfg.algorithm.routing_replay == "r3" and built == []


def test_replay_support_error_is_what_training_start_reports():
    """`gspo.moe.replay_support_error`, which the trainer's start checks call: a message naming the mode and the
    model for a dense preset, None for an MoE preset or for no replay."""
    from gspo.moe import replay_support_error

    error = replay_support_error("tiny-dense", "r3")
    assert error is not None
    assert "algorithm.routing_replay=r3 needs a Mixture-of-Experts model" in error
    assert "(model.name=tiny-dense)" in error
    assert replay_support_error("tiny-moe", "r2") is None
    assert replay_support_error("tiny-dense", "none") is None


def test_routing_replay_on_a_dense_preset_is_refused_at_training_start(tmp_path, monkeypatch):
    """A model the replay cannot run on is refused by `train` (`gspo.moe.replay_support_error`): the ConfigError
    (with its "(model.name=...)" suffix, which only the pre-load check adds) comes before the model is loaded and
    with nothing written in trainer.out."""
    from conftest import tiny_overrides
    from gspo import trainer

    out = tmp_path / "run"
    cfg = load_config(DEMO, tiny_overrides(out, "algorithm.routing_replay=r3", "model.name=tiny-dense"))
    monkeypatch.setattr(trainer, "load_model", lambda *a, **k: pytest.fail("the model was loaded before the check"),
                        raising=False)
    with pytest.raises(ConfigError, match=r"algorithm\.routing_replay=r3 needs a Mixture-of-Experts model.*"
                                          r"\(model\.name=tiny-dense\)"):
        trainer.train(cfg)
    assert not out.exists() or list(out.iterdir()) == []
