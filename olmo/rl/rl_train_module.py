"""The RL step as a train module (issue 53): :class:`RLTrainModule`, chosen by ``rl.enabled``.

Each step's batch is its prompts (instances of ``rl.prompts/input_ids.npy`` in the run's data order; this rank's
share). For each prompt of this rank the rollout engine samples ``rl.group_size`` completions with the weights of the
step's start (:mod:`olmo.rl.rollout`: what a completion holds depends on the seed, the step and the prompt's index
only); the rewards score them (:mod:`olmo.rl.step`); each group's advantages are its rewards against the group's
(:mod:`olmo.rl.policy_loss`); then, one group per forward and backward (every rank the same number), the policy loss with
the ratio to the sampling log-probabilities, normalised over the whole step (every rank's completions) as the loss
type says, and one optimizer step. With ``rl.num_mini_batches`` M the groups are cut into M parts, each normalised
alone and followed by its own optimizer step; ``rl.num_iterations`` passes over them all.

With several ranks sharding the model (FSDP), sampling runs on a full copy of the weights gathered once per step (no
collective while ranks sample completions of different lengths); ``train/rl/logprob_drift`` (the mean absolute
difference of the recomputed and the sampling log-probabilities over the step's tokens) shows any disagreement.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from ..checkpoint import inspect_checkpoint, load_checkpoint
from ..data.rl_prompts import RLPrompts
from ..distributed.collectives import DistEnv, all_reduce
from ..distributed.float8 import refresh_float8_scales
from ..distributed.parallelize import build_model
from ..model import OLMo
from ..optim import clip_grads, set_learning_rate
from ..tokenizer import Tokenizer
from ..train.metrics import ReduceType
from ..train.stages import Stage
from ..train.step_settings import StepSettings
from ..train.train_module import TransformerTrainModule
from .policy_loss import group_advantages, loss_denominator, reduce_losses, token_losses
from .rollout import BuiltinRolloutEngine, Group, RolloutEngine
from .rollout_records import rollout_record, write_rollouts
from .step import ScoredGroup, build_rewards, completion_logps, group_batch, score_group

__all__ = ["RLTrainModule"]

log = logging.getLogger(__name__)


class RLTrainModule(TransformerTrainModule):
    """Reinforcement learning with verifiable rewards (see the module's docstring); ``settings.rl`` is its section."""

    trains_rl = True

    def __init__(
        self, settings: StepSettings, env: DistEnv, model: OLMo, optimizer: torch.optim.Optimizer, scheduler: Any
    ):
        super().__init__(settings, env, model, optimizer, scheduler)
        rl = settings.rl
        assert rl.prompts is not None, "rl.prompts is checked with the config"
        self.rl = rl
        self.prompts = RLPrompts(rl.prompts)
        self.prompts.check_vocab(settings.model.vocab_size)
        self.tokenizer = Tokenizer.for_model(settings.tokenizer, settings.model)
        self.rewards = build_rewards(rl.rewards)
        self.eos, self.pad = settings.model.eos_token_id, settings.model.pad_token_id
        self._sampler: Optional[OLMo] = None  # the full copy several ranks sample with
        self._step_tokens = 0  # the tokens of the rows the last step trained on (all passes): its throughput
        self.reference: Optional[nn.Module] = None
        """With ``rl.beta > 0``: the frozen model of ``rl.reference_path`` (loaded when the first stage starts)."""

    def enter_stage(self, stage: Stage, at_boundary: bool) -> None:
        super().enter_stage(stage, at_boundary)
        if self.rl.beta > 0 and self.reference is None:
            path = str(self.rl.reference_path)
            reference = build_model(
                self.settings.model, self.trainer.layout, self.settings.parallel, init_params=False
            )
            reference.eval()
            reference.requires_grad_(False)
            info = inspect_checkpoint(path, "rl.reference_path")
            load_checkpoint(info, reference, None, load_trainer_state=False)
            log.info(
                "RL reference (rl.beta=%g): the model of %s (step %d), frozen.", self.rl.beta, path, info.step
            )
            self.reference = reference

    def engine(self, model: OLMo) -> RolloutEngine:
        """The built-in rollout engine on ``model``."""
        rl = self.rl
        return BuiltinRolloutEngine(
            model,
            group_size=rl.group_size,
            max_new_tokens=rl.max_new_tokens,
            temperature=rl.temperature,
            top_p=rl.top_p,
            eos=self.eos,
            seed=self.settings.seed,
            vocab_size=self.settings.model.vocab_size,
        )

    def _sampling_model(self) -> OLMo:
        """The model to sample with: the policy itself in one process, else a full copy of its weights (ranks sample
        completions of different lengths: no forward of theirs may wait on the others)."""
        model = self.model
        if self.env.world_size == 1:
            assert isinstance(model, OLMo)
            return model
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        if self._sampler is None:
            self._sampler = OLMo(self.settings.model, init_params=False).to(self.env.device)
        self._sampler.load_state_dict(full)
        return self._sampler

    def train_batch(self, batch: dict[str, Any], dry_run: bool = False) -> None:
        step = self.trainer.global_step
        indices = [int(i) for i in batch["index"].tolist()]
        start = time.perf_counter()
        engine = self.engine(self._sampling_model())
        groups = [engine.sample(torch.from_numpy(self.prompts.prompt(i)), i, step) for i in indices]
        rollout_seconds = time.perf_counter() - start
        scored = [self._score(group) for group in groups]
        reward_mean, reward_std = self._reward_stats(scored)
        advantages = self._advantages(scored, reward_std)
        start = time.perf_counter()
        self._step_tokens = 0
        sums: dict[str, torch.Tensor] = {}
        for n, part in enumerate(self._parts(len(groups))):
            if n:  # the optimizer step after each part but the last (the trainer's own)
                self._update()
            for name, value in self._train_groups(groups[part], advantages[part], first=n == 0).items():
                sums[name] = sums[name] + value if name in sums else value
        train_seconds = time.perf_counter() - start
        if not dry_run:
            self._record(scored, sums, (reward_mean, reward_std), rollout_seconds, train_seconds)
            self._keep(step, scored)

    def _parts(self, groups: int) -> list[slice]:
        """The groups each optimizer step trains on: ``rl.num_iterations`` passes over this rank's groups, each cut
        into ``rl.num_mini_batches`` runs of consecutive groups. Ranks hold every W-th prompt of the step, so the k-th
        run of every rank together is the k-th run of the step's prompts in data order: the same on any W."""
        M = self.rl.num_mini_batches
        size = groups // M  # the config checks that prompts_per_step splits evenly
        return [slice(k * size, (k + 1) * size) for _ in range(self.rl.num_iterations) for k in range(M)]

    def step_device_tokens(self) -> Optional[int]:
        """The tokens of the rows this rank trained on in the last step (a group's prompt and completions, padded
        to its longest, every pass): the step's tok/s and MFU count these, not the sampling."""
        return self._step_tokens

    def _update(self) -> None:
        """One optimizer step inside the RL step (more than one part): clipped as the trainer's, at the step's
        learning rate; the last part's step is the trainer's own (:meth:`optim_step`, with the step's metrics)."""
        step = self.trainer.global_step
        max_norm = self.scheduler.get_max_grad_norm(self.settings.max_grad_norm, step)
        clip_grads(self.optimizer, max_norm, self.settings.max_grad_norm_ratio, step)
        set_learning_rate(self.optimizer, self._learning_rate())
        self.optimizer.step()
        self.zero_grads()
        refresh_float8_scales(self.model)

    def _keep(self, step: int, scored: list[ScoredGroup]) -> None:
        """Write what this rank sampled at ``step`` and its rewards into the run (for ``inspect_batch.py``)."""
        records = []
        for s in scored:
            i = s.group.prompt_index
            names = [reward.name for reward in self.rewards]
            per_reward = [dict(zip(names, row)) for row in s.per_reward.tolist()]
            records.append(
                rollout_record(
                    step,
                    i,
                    self.prompts.sources[i],
                    self.prompts.ground_truths[i],
                    s.group.tokens,
                    s.group.truncated,
                    s.rewards.tolist(),
                    per_reward,
                    self.tokenizer.decode,
                    self.eos,
                )
            )
        write_rollouts(self.settings.save_folder, step, self.env.rank, records)

    def _score(self, group: Group) -> ScoredGroup:
        i = group.prompt_index
        prompt = self.tokenizer.decode(self.prompts.prompt(i).tolist(), skip_special_tokens=False)
        decode = self.tokenizer.decode
        return score_group(
            group, prompt, self.prompts.ground_truths[i], decode, self.rewards, self.eos, self.prompts.sources[i]
        )

    def _reward_stats(self, scored: list[ScoredGroup]) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean and (Bessel-corrected) standard deviation of the step's rewards over every rank: one reduction,
        for ``scale_rewards: batch`` and the metrics."""
        rewards = torch.cat([s.rewards for s in scored]).double()
        n = torch.tensor(float(rewards.numel()), dtype=torch.float64)
        totals = all_reduce(torch.stack([rewards.sum(), (rewards**2).sum(), n]).to(self.env.device)).cpu()
        mean = totals[0] / totals[2]
        std = ((totals[1] - totals[2] * mean**2) / (totals[2] - 1).clamp(min=1)).clamp(min=0).sqrt()
        return mean, std

    def _advantages(self, scored: list[ScoredGroup], batch_std: torch.Tensor) -> list[torch.Tensor]:
        """Each group's advantages (:func:`group_advantages`; ``scale_rewards: batch`` divides by every rank's)."""
        rewards = torch.cat([s.rewards for s in scored])
        advantages, _ = group_advantages(rewards, self.rl.group_size, self.rl.scale_rewards, batch_std)
        return list(advantages.split(self.rl.group_size))

    def _train_groups(
        self, groups: list[Group], advantages: list[torch.Tensor], first: bool
    ) -> dict[str, torch.Tensor]:
        """Forward and backward of each group, the loss normalised over these groups of every rank; this rank's
        metric sums (the drift only on the ``first`` part, before any update)."""
        rl, device, W = self.rl, self.env.device, self.env.world_size
        batches = [
            group_batch(
                torch.from_numpy(self.prompts.prompt(g.prompt_index)), g, self.pad, rl.mask_truncated_completions
            )
            for g in groups
        ]
        denominator = torch.zeros((), dtype=torch.float32, device=device)
        for b in batches:
            denominator += loss_denominator(b.completion_mask.to(device), rl.loss, rl.max_new_tokens)
        scale = W / all_reduce(denominator.clone()).clamp(
            min=1.0
        )  # FSDP averages gradients over ranks: W undoes it
        names = ("loss", "nll", "kl", "entropy", "clipped", "drift", "tokens", "drift_tokens")
        sums = {name: torch.zeros((), dtype=torch.float32, device=device) for name in names}
        for b, adv in zip(batches, advantages):
            self._step_tokens += b.input_ids.numel()
            b.input_ids, b.completion_ids = b.input_ids.to(device), b.completion_ids.to(device)
            mask, old = b.completion_mask.to(device), b.old_logps.to(device)
            with torch.autocast(device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
                logps, entropy = completion_logps(self.model, b, rl.temperature, self.settings.model.vocab_size)
            ref_logps = None
            if self.reference is not None:
                with (
                    torch.no_grad(),
                    torch.autocast(device.type, self.autocast_dtype, self.autocast_dtype is not None),
                ):
                    ref_logps, _ = completion_logps(
                        self.reference, b, rl.temperature, self.settings.model.vocab_size
                    )
            out = token_losses(
                logps,
                old,
                adv.to(device),
                loss=rl.loss,
                epsilon_low=rl.epsilon_low,
                epsilon_high=rl.upper_clip,
                beta=rl.beta,
                ref_logps=ref_logps,
            )
            numerator, _ = reduce_losses(out.loss, mask, rl.loss, rl.max_new_tokens)
            (numerator * scale).backward()
            m = mask.float()
            sums["loss"] += numerator.detach()
            sums["nll"] += -(logps.detach() * m).sum()
            sums["entropy"] += (entropy * m).sum()
            sums["clipped"] += (out.clipped.float() * m).sum()
            if first:
                sums["drift"] += ((logps.detach() - old).abs() * m).sum()
                sums["drift_tokens"] += m.sum()
            sums["tokens"] += m.sum()
            if out.kl is not None:
                sums["kl"] += (out.kl.detach() * m).sum()
        sums["loss_denominator"] = denominator
        return sums

    def _record(
        self,
        scored: list[ScoredGroup],
        sums: dict[str, torch.Tensor],
        reward_stats: tuple[torch.Tensor, torch.Tensor],
        rollout_seconds: float,
        train_seconds: float,
    ) -> None:
        device = self.env.device
        tokens = sums["tokens"]
        self.record_ce_loss(sums["nll"], all_reduce(tokens.clone()))
        mean, std = reward_stats
        n = torch.tensor(float(sum(len(s.group.tokens) for s in scored)), dtype=torch.float64)
        self.record_metric(
            "train/rl/loss", torch.stack([sums["loss"], sums["loss_denominator"]]), ReduceType.ratio
        )
        self.record_metric(
            "train/rl/reward_mean", mean.float().to(device), ReduceType.max
        )  # the same on every rank
        self.record_metric("train/rl/reward_std", std.float().to(device), ReduceType.max)
        per_reward = torch.cat([s.per_reward for s in scored]).double()
        for r, reward in enumerate(self.rewards):
            pair = torch.stack([per_reward[:, r].sum(), n]).float().to(device)
            self.record_metric(f"train/rl/rewards/{reward.name}", pair, ReduceType.ratio)
        for name in (
            ("kl", "entropy", "clipped", "drift")
            if self.reference is not None
            else ("entropy", "clipped", "drift")
        ):
            metric = {"clipped": "clip_fraction", "drift": "logprob_drift"}.get(name, name)
            count = sums["drift_tokens"] if name == "drift" else tokens
            self.record_metric(f"train/rl/{metric}", torch.stack([sums[name], count]), ReduceType.ratio)
        lengths = torch.tensor([float(len(t)) for s in scored for t in s.group.tokens], dtype=torch.float64)
        truncated = torch.tensor([float(x) for s in scored for x in s.group.truncated], dtype=torch.float64)
        for metric, values in (("completion_length", lengths), ("truncated_fraction", truncated)):
            pair = torch.stack([values.sum(), n]).float().to(device)
            self.record_metric(f"train/rl/{metric}", pair, ReduceType.ratio)
        self.record_metric(
            "throughput/rollout_seconds", torch.tensor(rollout_seconds, device=device), ReduceType.max
        )
        self.record_metric("throughput/train_seconds", torch.tensor(train_seconds, device=device), ReduceType.max)
