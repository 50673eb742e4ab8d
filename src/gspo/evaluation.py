"""Held-out evaluation: greedy decoding on held-out rows, scored by the run's rewards, with what accuracy means made
explicit (`rewards.accuracy_reward` >= `rewards.accuracy_threshold`, see `gspo.config.resolve_accuracy_reward`).

With `samples_per_prompt=n > 1`, n completions per row are sampled instead, and `evaluate` also reports pass@k
(`pass_at_k`, the unbiased estimator of Chen et al. 2021), its 95% interval across problems (`mean_ci95`) and maj@k
(`maj_at_k`, majority vote over `vote_answer` keys).

Every accuracy comes with its 95% interval (`accuracy_ci95`: Wilson's for greedy verdicts, `mean_ci95` for sampled
rows), and a change of accuracy on the same rows with the interval of the paired difference (`paired_change_ci95`):
on 200 held-out rows an accuracy near 50% is known to about ±7 points, which decides whether a difference is one."""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Hashable, Sequence

import torch

from gspo.config import resolve_accuracy_reward
from gspo.rewards import RewardRunner, answer_extractor
from gspo.rollout import HFSampler, SamplingParams
from gspo.tracking import markdown_table

__all__ = ["accuracy_by_group", "accuracy_ci95", "evaluate", "format_samples", "maj_at_k", "mean_ci95",
           "paired_change_ci95", "pass_at_k", "pass_at_k_ci95", "transcript", "vote_answer", "wilson_ci95"]

_Z95 = 1.959963984540054  # the standard normal's 97.5% quantile: a two-sided 95% interval is mean ± _Z95 · s.e.
_SEED_MIX = 2_654_435_761  # a sampled row's prompt seed is seed · _SEED_MIX + its position. Not seed << 32: torch's
# CPU generator keeps only a seed's low 32 bits, so seeds that differ by a multiple of 2**32 draw the same numbers


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k for one problem from `n` samples of which `c` are correct: Chen et al. 2021,
    "Evaluating Large Language Models Trained on Code" (arXiv 2107.03374), Eq. 1, pass@k = 1 − C(n−c, k) / C(n, k),
    the probability that k samples drawn without replacement from the n include a correct one. (The benchmark's
    pass@k is the mean of this over problems.)

    Computed in the paper's numerically stable product form (its Figure 3), C(n−c, k) / C(n, k) =
    ∏_{i=n−c+1}^{n} (1 − k/i), which never forms the huge binomials; 1.0 when n − c < k (every k-subset holds a
    correct sample). Raises ValueError unless 0 ≤ c ≤ n and 1 ≤ k ≤ n."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def vote_answer(completion: str) -> str | None:
    """The answer a completion votes for in maj@k when the accuracy reward extracts none (`gspo.rewards.with_answer`):
    its text stripped, with every run of whitespace made one space; None (no vote) for an empty completion. No
    task-specific parsing: completions that a verifier would accept as the same answer in different words ("579" and
    "579 ok" for addition) vote separately."""
    text = " ".join(completion.split())
    return text or None


def maj_at_k(answers: Sequence[Hashable | None], correct: Sequence[bool], k: int) -> float:
    """maj@k of one problem (majority voting, as in Wang et al. 2022, "Self-Consistency", arXiv 2203.11171): 1.0 if
    the most frequent answer among the first `k` samples is a correct one, else 0.0.

    `answers[j]` is sample j's answer key (None: it gave none, and does not vote), `correct[j]` whether the verifier
    accepted it. An answer is correct if any of its samples was judged correct (a deterministic verifier judges equal
    answers alike; "any" forgives a call that failed on one copy). Ties go to the answer that occurs first. No votes at
    all: 0.0.

    With more than k samples only the first k are used: the samples are i.i.d., so the first k are k draws like any
    other and the result is an unbiased (if noisier than averaging over every k-subset) estimate of maj@k."""
    if not 1 <= k <= len(answers) or len(correct) != len(answers):
        raise ValueError(f"maj_at_k needs 1 <= k <= {len(answers)} answers and one verdict per answer, got k={k} and "
                         f"{len(correct)} verdicts")
    votes = Counter(a for a in answers[:k] if a is not None)  # Counter keeps first-occurrence order
    if not votes:
        return 0.0
    top = max(votes.values())
    winner = next(a for a, count in votes.items() if count == top)
    return 1.0 if any(ok for a, ok in zip(answers[:k], correct[:k], strict=True) if a == winner) else 0.0


@functools.lru_cache(maxsize=256)
def t95(df: int) -> float:
    """Student's t distribution's 97.5% quantile with `df` degrees of freedom (12.706 at 1, 2.228 at 10, 1.984 at
    100, → 1.960): a two-sided 95% interval of a mean of df + 1 values is mean ± t95(df) · s.e. Found by bisection on
    the exact distribution function for integer df (Abramowitz & Stegun 26.7.3-4), to 1e-12: the normal's 1.96 made
    the interval of 16 problems 8% too narrow, of 4 problems 35%."""
    if df < 1:
        raise ValueError(f"t95: degrees of freedom must be >= 1, got {df}")

    def central(t: float) -> float:  # P(|T| <= t)
        theta = math.atan(t / math.sqrt(df))
        c2, term, total = math.cos(theta) ** 2, 1.0, 1.0
        for j in range(1 + df % 2, df - 1, 2):  # odd: 1, (2/3)c², (2·4)/(3·5)c⁴...; even: 1, (1/2)c², (1·3)/(2·4)c⁴...
            term *= c2 * j / (j + 1)
            total += term
        if df % 2 == 0:
            return math.sin(theta) * total
        return 2 / math.pi * (theta + (math.sin(theta) * math.cos(theta) * total if df > 1 else 0.0))

    low, high = 0.0, 64.0  # t95(1) = 12.7
    while high - low > 1e-12:
        mid = (low + high) / 2
        low, high = (mid, high) if central(mid) < 0.95 else (low, mid)
    return (low + high) / 2


def mean_ci95(values: Sequence[float]) -> tuple[float, float]:
    """A 95% confidence interval for the mean of per-problem estimates (e.g. pass@k): mean ± t95(P − 1) · s / √P
    with s the sample standard deviation (ddof 1) of the P values (Student's t: the normal's 1.96 undercovers a few
    problems), clipped to [0, 1] (the values are probabilities). Deterministic; zero width when all problems agree;
    (0, 1) for fewer than 2 problems, whose spread cannot be estimated. It covers the sampling of problems and of
    completions together (each problem's value already averages its own samples)."""
    if len(values) < 2:
        return 0.0, 1.0
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    half = t95(len(values) - 1) * std / math.sqrt(len(values))
    return max(0.0, mean - half), min(1.0, mean + half)


def wilson_ci95(successes: int, total: int) -> tuple[float, float]:
    """The Wilson score 95% interval of a proportion (Wilson 1927): unlike mean ± 1.96·s.e. it never has zero width
    and stays inside [0, 1], so 64 of 64 solved is [0.943, 1], not [1, 1]. (0, 1) for no trials. Its bound at 0 of n
    is exactly 0 and at n of n exactly 1 (the formula's float rounding gave 5.6e-17 and 0.9999999999999999: an
    accuracy outside its own interval)."""
    if total <= 0:
        return 0.0, 1.0
    p, z2 = successes / total, _Z95 ** 2
    centre = (p + z2 / (2 * total)) / (1 + z2 / total)
    half = _Z95 * math.sqrt(p * (1 - p) / total + z2 / (4 * total ** 2)) / (1 + z2 / total)
    low = 0.0 if successes <= 0 else max(0.0, centre - half)
    return low, 1.0 if successes >= total else min(1.0, centre + half)


def accuracy_ci95(row_values: Sequence[float]) -> tuple[float, float]:
    """The 95% interval of an accuracy from each row's solved fraction: Wilson's (`wilson_ci95`) when every value is
    0 or 1 (greedy verdicts), else `mean_ci95` of the rows' fractions (sampled evaluation: pass@1's interval)."""
    if all(v in (0.0, 1.0) for v in row_values):
        return wilson_ci95(round(sum(row_values)), len(row_values))
    return mean_ci95(row_values)


def paired_change_ci95(before: Sequence[float], after: Sequence[float]) -> tuple[float, float, float]:
    """(after − before, 95% low, 95% high) for two accuracies of the same rows, from each row's solved fraction at
    both times: the rows are paired, so the interval is that of the mean per-row difference, much narrower than two
    separate intervals suggest when most rows keep their verdict.

    Greedy verdicts (all values 0 or 1): Agresti & Min (2005), the Wald interval of the difference of paired
    proportions after adding 1/2 to each cell of the 2×2 table, which keeps a sensible width when few rows changed
    (the plain Wald interval has zero width when no row did). Sampled fractions: mean ± t95(P − 1) · s/√P of the
    per-row differences (the paired t interval). Clipped to [−1, 1]; (−1, 1) for fewer than 2 rows. Raises ValueError
    when the lengths differ."""
    if len(before) != len(after):
        raise ValueError(f"paired_change_ci95 needs the same rows twice, got {len(before)} and {len(after)} values")
    n = len(before)
    if n == 0:
        return 0.0, -1.0, 1.0
    diffs = [a - b for b, a in zip(before, after, strict=True)]
    change = sum(diffs) / n
    if n < 2:
        return change, -1.0, 1.0
    if all(v in (0.0, 1.0) for v in (*before, *after)):
        gained, lost = sum(d > 0 for d in diffs) + 0.5, sum(d < 0 for d in diffs) + 0.5  # rows 0 → 1, 1 → 0
        total = n + 2  # four cells, each + 1/2
        p_gained, p_lost = gained / total, lost / total
        centre = p_gained - p_lost
        half = _Z95 * math.sqrt(max(0.0, (p_gained + p_lost - centre ** 2) / total))
    else:
        centre = change
        std = math.sqrt(sum((d - change) ** 2 for d in diffs) / (n - 1))
        half = t95(n - 1) * std / math.sqrt(n)
    return change, max(-1.0, centre - half), min(1.0, centre + half)


def accuracy_by_group(row_values: Sequence[float], groups: Sequence[str],
                      first: Sequence[float] | None = None) -> dict[str, float]:
    """The held-out accuracy of each group of rows (`data.eval_by`: a source, a level, a file), as flat metrics keyed
    `NAME/GROUP`: `accuracy` with its interval (`accuracy_ci95`), `rows`, and with `first` (the same rows' values at
    an earlier evaluation) the change since then with its paired interval (`paired_change_ci95`). `row_values` are
    each row's solved fraction (`evaluate(row_values=...)`), `groups` each row's group; groups in sorted order.
    Raises ValueError when the lengths differ."""
    if len(groups) != len(row_values) or (first is not None and len(first) != len(row_values)):
        raise ValueError(f"accuracy_by_group: {len(row_values)} row values, {len(groups)} groups and "
                         f"{None if first is None else len(first)} first values; each row needs one of each")
    metrics: dict[str, float] = {}
    for group in sorted(set(groups)):
        rows = [i for i, g in enumerate(groups) if g == group]
        values = [row_values[i] for i in rows]
        low, high = accuracy_ci95(values)
        metrics |= {f"accuracy/{group}": sum(values) / len(values), f"accuracy_ci95_low/{group}": low,
                    f"accuracy_ci95_high/{group}": high, f"rows/{group}": len(values)}
        if first is not None:
            change, low, high = paired_change_ci95([first[i] for i in rows], values)
            metrics |= {f"accuracy_change/{group}": change, f"accuracy_change_ci95_low/{group}": low,
                        f"accuracy_change_ci95_high/{group}": high}
    return metrics


def merge_shards(shards: Sequence[tuple[dict[str, float], int]]) -> dict[str, float]:
    """`evaluate`'s results on shards of the rows (result, rows), as one call on all of them gives them: row means
    weighted by rows, the tool-call fractions of `gspo.agent.episodes.count_metrics` by the calls they are over
    (`tool_call_validity` of the call attempts, NaN without any: a shard without calls adds nothing; `tool_failures`
    of the well-formed calls, 0 without). Shards with no rows are left out; the keys are those of the first that has
    rows. Not the intervals: recompute those from every row's values (see `evaluate`)."""
    shards = [(result, rows) for result, rows in shards if rows]
    merged = {}
    for key in shards[0][0]:
        weights = []
        for result, rows in shards:
            calls = result.get("tool_calls", 0.0) * rows
            valid = calls * result["tool_call_validity"] if calls else 0.0
            weights.append(calls if key == "tool_call_validity" else valid if key == "tool_failures" else rows)
        total = sum(weights)
        merged[key] = (sum(r[key] * w for (r, _), w in zip(shards, weights, strict=True) if w) / total if total
                       else math.nan if key == "tool_call_validity" else 0.0)
    return merged


def evaluate(model, tokenizer, rows: list[dict], rewards: RewardRunner, max_new_tokens: int,
             batch_size: int = 256, sampler=None, accuracy_reward: str | Sequence[str] | None = None,
             accuracy_threshold: float = 1.0, samples: list[dict] | None = None,
             n_samples: int = 0, *, samples_per_prompt: int = 1, temperature: float = 1.0, top_p: float = 1.0,
             ks: Sequence[int] = (1,), seed: int = 0,
             answer_of: Callable[[str], Hashable | None] | None = None, episodes=None,
             row_values: list[float] | None = None, row_offset: int = 0,
             stop: Sequence[str] = (), autocast: torch.dtype | str | None = None) -> dict[str, float]:
    """Greedy decoding on `rows`, scored by `rewards`; a completion ends at EOS, after `max_new_tokens`, or at the
    first of the `stop` strings (the run's `rollout.stop`: held-out completions end where training ones do).
    Returns row means: `accuracy` (the fraction solved: the unweighted value of `accuracy_reward` (default: the only
    function, or the only built-in verifier) is at least `accuracy_threshold`, so other rewards' weights do not
    change it; several for mixed data: each that scores the row, `RewardScores.correct`), `reward_mean` (the weighted
    sum),
    `reward_failure_rate` (rows on which some reward function failed), `response_length`, `truncation_rate`; and
    `accuracy_ci95_low` / `accuracy_ci95_high` (`accuracy_ci95`); with a reward that judges the answer after a
    reasoning block (`gspo.rewards.thinking`), `unfinished_thinking_rate`, the fraction of completions whose
    reasoning never ended (no answer: raise `max_new_tokens` when it is high). Each row's solved fraction (0 or 1
    here) is appended to `row_values` when given, in row order (for `paired_change_ci95` against another
    evaluation). The first `n_samples` rows' prompts, first completions, rewards (the weighted sum and each
    function's value), verdicts and truncation are appended to `samples`.
    `sampler`: the rollout engine to decode with (the run's own, with greedy settings for this call); default an
    HFSampler on `model`, sampling under `autocast` (a run's trainer.mixed_precision, as its own engine does).

    `samples_per_prompt=n > 1` samples n completions per row instead (at `temperature` and `top_p`; row i's are a
    function of `seed` and `row_offset` + i alone, so a call is reproducible whatever `batch_size`, which then counts
    completions: `batch_size // n` rows per generate call). The five means are then over all n·rows completions
    (`accuracy`, the mean per-sample accuracy, is the pass@1 estimate; `reward_failure_rate` the fraction of
    completions with a failed reward call), `samples` gets each row's first completion, and for every k in `ks`
    (1 <= k <= n) it adds `pass@{k}` (the mean over rows of `pass_at_k`), `pass@{k}_ci95_low` / `pass@{k}_ci95_high`
    (`pass_at_k_ci95`) and `maj@{k}` (the mean of `maj_at_k` over the rows' first k samples, voting on
    `answer_of(text)` of the text the accuracy reward judges (`RewardScores.texts`); default: the answer that
    reward extracts (`gspo.rewards.with_answer`; the built-in addition, last_number and math rewards have one), else
    `vote_answer`). With n = 1 (the default) `ks`, `seed`, `row_offset` and `answer_of` are unused and the result is
    the greedy one above, unchanged. Raises ValueError for n < 1, an empty `ks` or a k outside [1, n], and (n > 1) a
    temperature or top_p that `SamplingParams` refuses.

    The interval keys are not row means: a caller that evaluates shards of the rows separately (several processes)
    must not average them; recompute them from every row's values instead (`accuracy_ci95` and `pass_at_k_ci95` of
    the `row_values`). Such a caller passes each shard's `row_offset`, the position of its first row among all the
    rows, so that row i of the shard draws the completions of row `row_offset + i`, as one call on all the rows does.

    `episodes` (a `gspo.agent.EpisodeRunner`): each row is a multi-turn episode instead (`max_new_tokens` per policy
    turn); the rewards score its final reply, `reward_mean` adds the environment's turn rewards, the result adds the
    episode and tool-use rates (`gspo.agent.episodes.count_metrics`), and samples carry the whole `transcript`."""
    n = samples_per_prompt
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"evaluate: samples_per_prompt must be an int >= 1, got {n!r}")
    ks = list(ks)
    if not ks or not all(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= n for k in ks):
        raise ValueError(f"evaluate: every k in ks must be an int in [1, samples_per_prompt={n}], got {ks}")
    ks = sorted(set(ks))
    if n == 1:
        params = SamplingParams(top_k=1, max_new_tokens=max_new_tokens, stop=tuple(stop))  # greedy
    else:
        params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, stop=tuple(stop))
    sampler = sampler or HFSampler(model, tokenizer, params, autocast=autocast)
    accuracy_reward = resolve_accuracy_reward(rewards.names, accuracy_reward, key="evaluate(accuracy_reward=...)")
    judges = [accuracy_reward] if isinstance(accuracy_reward, str) else accuracy_reward  # several: mixed data
    readers = {name: answer_of or answer_extractor(rewards.functions[rewards.names.index(name)]) or vote_answer
               for name in judges}  # maj@k: each completion's answer as its row's accuracy reward reads it
    per_call = batch_size if n == 1 else max(1, batch_size // n)
    scores, correct, failed, lengths, truncated, answers, counts, unfinished = [], [], [], [], [], [], [], []
    for start in range(0, len(rows), per_call):
        chunk = rows[start:start + per_call]
        prompts = [r["prompt"] for r in chunk]
        seeds = ([0] * len(prompts) if n == 1 else
                 [seed * _SEED_MIX + row_offset + start + i for i in range(len(chunk))])
        if episodes is not None:
            batch = episodes.run(chunk, n, seeds, params)
            counts.append(batch.extras["episode"].cpu())
        else:
            batch = sampler.generate(prompts, n, seeds, params=params)
        # completion j answers prompt j // n (prompt-major)
        scored = rewards.score([p for p in prompts for _ in range(n)], batch.completions,
                               [r for r in chunk for _ in range(n)])
        if "unfinished_thinking" in scored.stats:
            unfinished.append(scored.stats["unfinished_thinking"])
        turns = 0.0 if batch.token_rewards is None else batch.token_rewards.sum(-1).cpu()
        scores.append(scored.total + turns)
        correct.append(scored.correct(accuracy_reward, accuracy_threshold))
        failed.append(scored.rows_failed())
        lengths.append(batch.completion_mask.sum(-1).float().cpu())
        truncated.append(batch.truncated.float().cpu())
        if n > 1:
            answers.extend(_vote(readers[name], scored.texts[name][i])
                           for i, name in enumerate(scored.judge(accuracy_reward)))
        if samples is not None and len(samples) < n_samples:
            for i in range(min(n_samples - len(samples), len(chunk))):
                j = i * n  # the row's first completion
                samples.append({"prompt": prompts[i], "completion": batch.completions[j],
                                "reward": float(scores[-1][j]), "correct": bool(correct[-1][j]),
                                "rewards": {name: float(scored.values[name][j]) if bool(scored.applies[name][j])
                                            else None for name in rewards.names},  # None: not its route
                                "truncated": bool(batch.truncated[j]),
                                **({"answer": chunk[i]["answer"]} if "answer" in chunk[i] else {}),
                                **({"transcript": transcript(tokenizer, batch, i * n)} if episodes else {})})
    solved = torch.cat(correct).float().view(-1, n).mean(-1).tolist()  # each row's solved fraction
    if row_values is not None:
        row_values.extend(solved)
    low, high = accuracy_ci95(solved)
    result = {
        "accuracy": sum(solved) / len(solved),  # the mean of the rows' solved fractions (= over all completions)
        "accuracy_ci95_low": low,
        "accuracy_ci95_high": high,
        "reward_mean": float(torch.cat(scores).mean()),
        "reward_failure_rate": float(torch.cat(failed).float().mean()),
        "response_length": float(torch.cat(lengths).mean()),
        "truncation_rate": float(torch.cat(truncated).mean()),
    }
    if unfinished:  # reasoning that never ended: scored as no answer by the verifiers (gspo.rewards.thinking)
        result["unfinished_thinking_rate"] = sum(unfinished) / sum(len(x) for x in lengths)
    if counts:
        from gspo.agent.episodes import count_metrics

        result.update(count_metrics(torch.cat(counts), batch.extras["episode_keys"]))
    if n > 1:
        result.update(_pass_and_majority(torch.cat(correct).view(-1, n).tolist(), answers, ks))
    return result


def _vote(answer_of: Callable[[str], Hashable | None], completion: str) -> Hashable | None:
    """`answer_of(completion)`, or a ValueError naming the extractor and the completion when it raises or returns
    something maj@k cannot count (unhashable)."""
    name = getattr(answer_of, "__qualname__", repr(answer_of))
    try:
        answer = answer_of(completion)
        hash(answer)
    except Exception as exc:
        raise ValueError(f"maj@k: the answer extractor {name} failed on the completion {completion[:60]!r}: "
                         f"{type(exc).__name__}: {exc} (it must return a hashable answer, or None: no vote)") from exc
    return answer


def transcript(tokenizer, batch, i: int) -> str:
    """Row i's whole response (policy turns and observations) as text."""
    return tokenizer.decode(batch.completion_ids[i][batch.completion_mask[i].bool()].tolist(), skip_special_tokens=True)


def pass_at_k_ci95(row_values: Sequence[float], n: int, ks: Sequence[int]) -> dict[str, float]:
    """`pass@{k}_ci95_low` / `_high` for each k in `ks` from each row's solved fraction of its `n` samples (what
    `evaluate(row_values=...)` collects): `accuracy_ci95` of the rows' `pass_at_k` estimates, the rule the accuracy's
    interval follows (pass@1 is the accuracy: one interval for one number; Wilson's where every row's estimate is 0 or
    1, which `mean_ci95` would give zero width). A caller that evaluated shards of the rows separately recomputes the
    intervals from every row's values with this."""
    solved = [round(v * n) for v in row_values]
    out: dict[str, float] = {}
    for k in ks:
        out[f"pass@{k}_ci95_low"], out[f"pass@{k}_ci95_high"] = accuracy_ci95([pass_at_k(n, c, k) for c in solved])
    return out


def _pass_and_majority(correct: list[list[bool]], answers: list[Hashable | None],
                       ks: Sequence[int]) -> dict[str, float]:
    """pass@k, its interval and maj@k for each k in `ks`, from each row's n verdicts and the n·rows answers."""
    n = len(correct[0])
    solved = [sum(row) for row in correct]
    out: dict[str, float] = pass_at_k_ci95([c / n for c in solved], n, ks)
    for k in ks:
        out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in solved) / len(solved)
        out[f"maj@{k}"] = sum(maj_at_k(answers[i * n:(i + 1) * n], row, k)
                              for i, row in enumerate(correct)) / len(correct)
    return out


def format_samples(step: int, samples: list[dict]) -> str:
    """Sample completions as a Markdown table (TensorBoard's text tab renders it)."""
    return markdown_table(f"held-out samples at step {step}", samples, ("prompt", "completion", "reward", "correct"))
