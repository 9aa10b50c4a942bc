"""What an RL run checks at launch, before anything is built or written (issue 53): its prompts open and fit the
model (:func:`check_rl_run`), and every reward it names exists."""

from __future__ import annotations

from ..config import ModelConfig, RLConfig
from ..data.rl_prompts import RLPrompts
from ..exceptions import OLMoConfigurationError
from .step import build_rewards

__all__ = ["check_rl_run"]


def check_rl_run(rl: RLConfig, model: ModelConfig) -> RLPrompts:
    """Open ``rl.prompts`` (every file checked), and refuse, naming the keys, prompts that do not fit
    ``model.max_sequence_length`` with ``rl.max_new_tokens`` more, token ids the model lacks, or a reward that is
    neither built in nor registered."""
    assert rl.prompts is not None
    prompts = RLPrompts(rl.prompts)
    prompts.check_vocab(model.vocab_size)
    if prompts.seq_len != model.max_sequence_length:
        raise OLMoConfigurationError(
            f"rl.prompts '{rl.prompts}' holds instances of {prompts.seq_len} tokens (prepare_rl_prompts.py "
            f"--seq-len), but model.max_sequence_length={model.max_sequence_length}: they must be equal. Prepare the "
            f"prompts again with --seq-len {model.max_sequence_length}."
        )
    if prompts.max_prompt_tokens + rl.max_new_tokens > model.max_sequence_length:
        raise OLMoConfigurationError(
            f"rl.prompts' longest prompt ({prompts.max_prompt_tokens} tokens) and rl.max_new_tokens="
            f"{rl.max_new_tokens} do not fit model.max_sequence_length={model.max_sequence_length}. Lower "
            f"rl.max_new_tokens to {model.max_sequence_length - prompts.max_prompt_tokens}, or prepare the prompts "
            f"again with --max-prompt-tokens {max(1, model.max_sequence_length - rl.max_new_tokens)}."
        )
    build_rewards(rl.rewards)  # an unknown name fails here
    return prompts
