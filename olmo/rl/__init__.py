"""Reinforcement learning with verifiable rewards (issue 53; being built): the rewards (:mod:`olmo.rl.rewards`),
by name: the built-in ``exact_answer``, ``format`` and ``length``, and a user's own, registered with
:func:`register_reward`; the group advantages and policy losses (:mod:`olmo.rl.policy_loss`: ``grpo``, ``dr_grpo``,
``dapo``, ``cispo``, as TRL defines them); the built-in rollout engine (:mod:`olmo.rl.rollout`), the step's pieces
(:mod:`olmo.rl.step`), the checks of a launch (:mod:`olmo.rl.run_checks`) and the RL step as a train module
(:mod:`olmo.rl.rl_train_module`, chosen by ``rl.enabled``). May import every package below ``olmo.bench``.
"""

from __future__ import annotations

from .rewards import Completion, register_reward, registered_rewards

__all__ = ["Completion", "register_reward", "registered_rewards"]
