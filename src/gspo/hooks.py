"""Learner hooks: what runs around the learner's forwards besides the paper's algorithm.

A hook can wrap each π_old forward and each π_θ forward in a context (MoE routing capture and replay), add per-process
metrics of an update (averaged over the processes as they give them), and add batch metrics once the step's
updates are done. `gspo.learner.learn` calls them; the trainer chooses which to install:

    MoERouting        §5.3: records π_old's routing, replays it (R2) or the engine's (R3) in the training forwards,
                      and measures expert volatility and the engine–trainer routing mismatch
    PrecisionMetrics  §5.4: how far the engine's log-probabilities are from the trainer's under the same weights
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch

from gspo.moe import RoutingCapture, routing_change, routing_change_counts

if TYPE_CHECKING:
    from gspo.parallel import ProcessGroup
    from gspo.trajectory import Trajectory

__all__ = ["LearnHook", "MoERouting", "PrecisionMetrics", "precision_ratio_metrics"]


class LearnHook:
    """The learner's extension points; every method is a no-op here."""

    def start(self, traj: Trajectory) -> None:
        """Before the step's forwards, with the step's (global) trajectories."""

    def keeps_layout(self, phase: str) -> bool:
        """Whether the forwards of `phase` ("old" or "update") must keep the padded [N, S + T] token layout (a hook that
        captures per-token state does); otherwise they trim padding (`gspo.logprobs`)."""
        return False

    def old_forward(self, rows: torch.Tensor) -> AbstractContextManager:
        """Around the π_old forward of `rows` (only when π_old is recomputed by the trainer)."""
        return contextlib.nullcontext()

    def old_done(self, group: ProcessGroup, minibatches: Sequence[torch.Tensor]) -> None:
        """After every π_old forward: per-row results of this process's shares can be merged (`group.merge_rows`)."""

    def update_forward(self, k: int, rows: torch.Tensor, last: bool) -> AbstractContextManager:
        """Around the π_θ forward of update `k` on `rows` (`last`: the step's last update)."""
        return contextlib.nullcontext()

    def first_update_forward(self, rows: torch.Tensor, last: bool) -> AbstractContextManager:
        """Around the first update's forward of `rows` when it is also their π_old forward (π_old recomputed without
        a correction: the weights are π_old's, so the learner runs no no-grad forward for these rows; `gspo.learner`).
        `update_forward(0, ...)` unless the hook captures π_old state, which it then captures here."""
        return self.update_forward(0, rows, last)

    def update_metrics(self, k: int, rows: torch.Tensor, logprobs: torch.Tensor,
                       old_logprobs: torch.Tensor) -> dict[str, float]:
        """Metrics of update `k` (this process's share), taken as they are (not averaged over the minibatches)."""
        return {}

    def batch_metrics(self, traj: Trajectory, old_logprobs: torch.Tensor) -> dict[str, float]:
        """Metrics of the whole step, once every update is done (the same on every process)."""
        return {}


def precision_ratio_metrics(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
                            mask: torch.Tensor) -> dict[str, float]:
    """Ratio noise between the trainer's and the engine's log-probabilities of the same tokens under the same weights
    (§5.4): std over tokens of w_{i,t} = π_trainer/π_engine, and std over sequences of s_i = exp(mean_t log w_{i,t}).
    Non-zero only through numerics (e.g. a bf16 engine for an fp32 trainer); GRPO clips w, GSPO clips s."""
    return _ratio_stds(_ratio_sums(trainer_logprobs, engine_logprobs, mask))


def _ratio_sums(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """Σ(w − 1), Σ(w − 1)², count over tokens, then the same over sequences for s: sums that add up over the rows of
    several processes (a std per process, averaged, was 0 with one sequence per process)."""
    log_w = torch.where(mask, trainer_logprobs - engine_logprobs, trainer_logprobs.new_zeros(()))
    nonempty = mask.any(-1)
    log_s = log_w.sum(-1)[nonempty] / mask.sum(-1)[nonempty]
    sums = []
    for d in (log_w[mask].double().expm1(), log_s.double().expm1()):  # about 1 ± 1e-3: centred, no cancellation
        sums += [float(d.sum()), float((d * d).sum()), float(d.numel())]
    return sums


def _ratio_stds(sums: Sequence[float]) -> dict[str, float]:
    """The sample stds (ddof 1) of `_ratio_sums`' tokens and sequences; 0 for fewer than two."""
    def std(total: float, squares: float, n: float) -> float:
        return math.sqrt(max(squares - total * total / n, 0.0) / (n - 1)) if n > 1 else 0.0
    return {"precision_ratio_std_token": std(*sums[:3]), "precision_ratio_std_seq": std(*sums[3:])}


class PrecisionMetrics(LearnHook):
    """§5.4 diagnostics. With π_old from the engine (`from_engine`): the first update's ratio noise, trainer vs engine
    under the same weights (the first minibatch is on-policy). With π_old recomputed: after the step, the mean absolute
    difference between the engine's and the trainer's log-probabilities and the same ratio noise, over the batch."""

    def __init__(self, from_engine: bool) -> None:
        self.from_engine = from_engine

    def update_metrics(self, k: int, rows: torch.Tensor, logprobs: torch.Tensor,
                       old_logprobs: torch.Tensor) -> dict[str, float]:
        if k == 0 and self.from_engine:  # this process's share; the stds are of every process's (`batch_metrics`)
            self._sums = _ratio_sums(logprobs.detach(), old_logprobs[rows], self._mask[rows])
        return {}

    def batch_metrics(self, traj: Trajectory, old_logprobs: torch.Tensor) -> dict[str, float]:
        if self.from_engine:
            return _ratio_stds(self._group.all_sum(self._sums))
        mask = traj.loss_mask.bool()
        diff = (traj.logprobs - old_logprobs)[mask].abs()
        return {"rollout_logprob_diff": float(diff.mean()),
                **precision_ratio_metrics(old_logprobs, traj.logprobs, mask)}

    def start(self, traj: Trajectory) -> None:
        self._mask = traj.loss_mask.bool()
        self._sums = [0.0] * 6

    def old_done(self, group: ProcessGroup, minibatches: Sequence[torch.Tensor]) -> None:
        self._group = group


class MoERouting(LearnHook):
    """MoE routing around the training forwards (§5.3), for a policy whose routers have an adapter (`gspo.moe`).

    The π_old forward records each token's routing (the router's own choice; under R3 with the engine's routing
    replayed); `replay` "r2" replays that in every π_θ forward, "r3" the engine's (`traj.extras["routing"]`), "none"
    nothing. Expert volatility is measured for free on the last update: the fraction of its tokens' expert activations
    that the router now picks differently from π_old's. With R3, the engine–trainer routing mismatch is reported.
    Routing is captured over the padded [N, S + T] layout, so every forward that captures keeps that layout (and the
    first minibatch's ratios stay exactly 1)."""

    def __init__(self, model: torch.nn.Module, replay: str = "none") -> None:
        self.model = model
        self.replay_mode = replay

    def start(self, traj: Trajectory) -> None:
        self.engine_routing = traj.extras.get("routing")  # R3: the rollout engine's routing, [N, S+T, layers, k]
        if self.replay_mode == "r3" and self.engine_routing is None:  # it trained as "none", saying r3
            raise ValueError("routing_replay=r3 replays the rollout engine's routing, but these rollouts carry none "
                             "(traj.extras['routing']: an engine with record_routing=True records it)")
        self.token_mask = traj.token_mask
        self.n_rows = len(traj)
        self.old_routing: torch.Tensor | None = None
        self.new_routing: torch.Tensor | None = None
        self.measured = False  # whether the last update measures volatility (the same on every process)
        self.volatility = [0.0, 0.0]  # changed, counted activations of this process's rows

    @property
    def replay(self) -> torch.Tensor | None:
        return {"r2": self.old_routing, "r3": self.engine_routing}.get(self.replay_mode)

    def keeps_layout(self, phase: str) -> bool:
        return True if phase == "old" else (self.old_routing is not None or self.replay is not None)

    def old_forward(self, rows: torch.Tensor) -> AbstractContextManager:
        return self._capture(self.engine_routing, rows, self._store_old)

    def first_update_forward(self, rows: torch.Tensor, last: bool) -> AbstractContextManager:
        # at π_old's weights the routing this forward picks is π_old's (R2 replays exactly that: nothing to replay yet)
        return self.old_forward(rows)

    def _store_old(self, rows: torch.Tensor, chosen: torch.Tensor) -> None:
        width = self.token_mask.shape[1]
        if self.old_routing is None:
            self.old_routing = chosen.new_empty((self.n_rows, width, *chosen.shape[1:]))
        self.old_routing[rows] = chosen.view(len(rows), width, *chosen.shape[1:])

    def old_done(self, group: ProcessGroup, minibatches: Sequence[torch.Tensor]) -> None:
        self.old_routing = group.merge_rows(self.old_routing, minibatches)
        self.group = group

    def update_forward(self, k: int, rows: torch.Tensor, last: bool) -> AbstractContextManager:
        if not self.keeps_layout("update"):
            return contextlib.nullcontext()
        measure = self.old_routing is not None and last and k > 0
        self.measured = self.measured or measure
        return self._capture(self.replay, rows, self._store_new if measure else None)

    def _store_new(self, rows: torch.Tensor, chosen: torch.Tensor) -> None:
        """π_θ's routing of `rows` on the last update (one call per micro-batch of its minibatch)."""
        if self.new_routing is None:
            self.new_routing = torch.full_like(self.old_routing, -1)
        self.new_routing[rows] = chosen.view(self.old_routing[rows].shape)

    def update_metrics(self, k: int, rows: torch.Tensor, logprobs: torch.Tensor,
                       old_logprobs: torch.Tensor) -> dict[str, float]:
        if self.new_routing is not None:  # counts of this process's rows; the fraction is of all (`batch_metrics`)
            new, self.new_routing = self.new_routing[rows], None
            self.volatility = list(routing_change_counts(self.old_routing[rows], new, self.token_mask[rows]))
        return {}

    def batch_metrics(self, traj: Trajectory, old_logprobs: torch.Tensor) -> dict[str, float]:
        metrics = {}
        if self.measured:
            changed, counted = self.group.all_sum(self.volatility)
            metrics["expert_volatility"] = changed / counted if counted else float("nan")
        if self.engine_routing is not None and self.old_routing is not None:
            metrics["rollout_routing_mismatch"] = routing_change(self.engine_routing, self.old_routing,
                                                                 self.token_mask)
        return metrics

    @contextlib.contextmanager
    def _capture(self, replay: torch.Tensor | None, rows: torch.Tensor, then):
        """Capture the routing of one forward over `rows`, replaying `replay[rows]` when given; hand the chosen experts
        to `then(rows, chosen)`."""
        with RoutingCapture(self.model, replay=None if replay is None else replay[rows]) as cap:
            yield
        chosen = cap.take().chosen
        if then is not None:
            then(rows, chosen)
