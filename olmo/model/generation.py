"""Text generation with the KV cache: :func:`generate` (``OLMo.generate``, OLMo's signature) and the samplers that
the command line's ``--temperature``, ``--top_k`` and ``--top_p`` choose.

The prompt runs once (``use_cache=True``, last logits only); every later step feeds the beams' last tokens with the
cache: each attention layer's keys and values, each linear-attention layer's recurrent state (its convolution's
window and delta-rule state, :class:`~olmo.model.recurrent_cache.RecurrentState`), which
:class:`~olmo.model.beams.BeamSearch` reorders with the beams. Prompts of different lengths are padded on the left
with an ``attention_mask``: padding keys are hidden from every query, a linear-attention layer starts afresh at a
prompt's first real token, and with RoPE or ALiBi (relative positions) a padded prompt continues exactly as it would
alone; with learned absolute positions (``wpe``) the padding shifts its positions, as in the original OLMo. Blocks compiled with
``torch.compile`` run eagerly while generating, so that no new length recompiles them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Optional

import torch
import torch.nn.functional as F

from .beams import (
    BeamSearch,
    Constraint,
    DeterministicSampler,
    FinalSequenceScorer,
    MultinomialSampler,
    Sampler,
    StateType,
    TopKSampler,
    TopPSampler,
)
from .recurrent_cache import LayerCache, RecurrentState

if TYPE_CHECKING:
    from .transformer import OLMo

__all__ = ["OLMoGenerateOutput", "generate", "build_sampler", "left_padded", "until_end", "TokenCallback"]


class OLMoGenerateOutput(NamedTuple):
    token_ids: torch.Tensor
    """(batch, beam_size, max_steps) generated token ids (the prompt not included), padded with the end token."""
    scores: torch.Tensor
    """(batch, beam_size) the beams' scores (by default their log-probabilities), best first."""


TokenCallback = Callable[[torch.Tensor], None]
"""Called after every step with the (B * beam,) tokens just chosen (before the beams are sorted)."""


def build_sampler(temperature: float = 0.0, top_k: Optional[int] = None, top_p: Optional[float] = None) -> Sampler:
    """The sampler for the usual generation options: ``temperature`` 0 is greedy (the most likely token); otherwise
    sampling at that temperature, from the ``top_k`` most likely tokens or from the nucleus of probability
    ``top_p`` when given (not both).

    :raises ValueError: naming the option, for values that make no sense.
    """
    if not 0 <= temperature < math.inf:
        raise ValueError(f"--temperature={temperature} must be finite and >= 0 (0: greedy decoding).")
    if top_k is not None and top_p is not None:
        raise ValueError("Give --top_k or --top_p, not both.")
    if top_k is not None and top_k < 1:
        raise ValueError(f"--top_k={top_k} must be at least 1.")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"--top_p={top_p} must be in (0, 1].")
    if temperature == 0:
        if top_k is not None or top_p is not None:
            raise ValueError("--top_k and --top_p sample: give a --temperature above 0 with them (e.g. 0.8).")
        return DeterministicSampler()
    if top_k is not None:
        return TopKSampler(k=top_k, temperature=temperature)
    if top_p is not None:
        return TopPSampler(p=top_p, temperature=temperature)
    return MultinomialSampler(temperature=temperature)


def left_padded(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Token-id prompts as one (B, T) batch padded on the left (every prompt's last token in the last column), and
    its attention mask: None when no prompt is padded, so that unpadded prompts run exactly as alone."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, longest - len(prompt) :] = 1
    return ids, None if bool(mask.all()) else mask


def until_end(tokens: list[int], end_index: int) -> list[int]:
    """A generated sequence up to (without) its first end token."""
    return tokens[: tokens.index(end_index)] if end_index in tokens else tokens


def _flatten(cache: list[LayerCache], state: StateType) -> None:
    """Put every block's cache tensors (batch first) into the search's ``state``, which reorders them with the
    beams."""
    for i, layer in enumerate(cache):
        if isinstance(layer, RecurrentState):
            state[f"conv_{i}"], state[f"recurrent_{i}"] = layer.conv, layer.state
        else:
            state[f"past_key_{i}"], state[f"past_value_{i}"] = layer


def _unflatten(state: StateType, n_layers: int, length: int) -> list[LayerCache]:
    """The blocks' caches from ``state``, after ``length`` positions."""
    return [
        RecurrentState(state[f"conv_{i}"], state[f"recurrent_{i}"], length)
        if f"conv_{i}" in state
        else (state[f"past_key_{i}"], state[f"past_value_{i}"])
        for i in range(n_layers)
    ]


@torch.no_grad()
def generate(
    model: OLMo,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    attention_bias: Optional[torch.Tensor] = None,
    max_steps: int = 10,
    beam_size: int = 1,
    per_node_beam_size: Optional[int] = None,
    sampler: Optional[Sampler] = None,
    min_steps: Optional[int] = None,
    final_sequence_scorer: Optional[FinalSequenceScorer] = None,
    constraints: Optional[list[Constraint]] = None,
    *,
    end_index: Optional[int] = None,
    on_token: Optional[TokenCallback] = None,
) -> OLMoGenerateOutput:
    """Continue the (B, T) prompts ``input_ids`` by up to ``max_steps`` tokens; see :meth:`olmo.model.OLMo.generate`.

    :param end_index: The token that ends a sequence; default ``model.config.eos_token_id``.
    :param on_token: Called with each step's tokens (for streaming them).
    :raises ValueError: for a mask or bias of the wrong shape, or prompts padded on the right.
    """
    batch_size, prompt_length = input_ids.shape
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}; it must match input_ids "
                f"{tuple(input_ids.shape)}."
            )
        if not bool(attention_mask[:, -1].bool().all()):
            raise ValueError(
                "A prompt ends with padding (attention_mask 0 in the last column): pad prompts on the left for "
                "generation (data.pad_direction=left), so that every prompt's last token is real."
            )
    if attention_bias is not None and (attention_bias.dim() != 4 or attention_bias.size(-1) < prompt_length):
        raise ValueError(
            f"attention_bias has shape {tuple(attention_bias.shape)}; it must be (batch, 1, T + max_steps, "
            f"T + max_steps) for prompts of T={prompt_length} tokens."
        )
    search = BeamSearch(
        model.config.eos_token_id if end_index is None else end_index,
        max_steps=max_steps,
        beam_size=beam_size,
        per_node_beam_size=per_node_beam_size,
        sampler=sampler,
        min_steps=min_steps,
        final_sequence_scorer=final_sequence_scorer,
        constraints=constraints,
    )
    n_layers = model.config.n_layers
    length = 0  # positions in the cache

    def step(last_predictions: torch.Tensor, state: StateType) -> tuple[torch.Tensor, StateType]:
        nonlocal length
        mask, bias = state.get("attention_mask"), state.get("attention_bias")
        if length:
            if on_token is not None:
                on_token(last_predictions)
            ids = last_predictions.unsqueeze(1)  # (B * beam, 1)
            past = _unflatten(state, n_layers, length)
            if mask is not None:
                mask = torch.cat((mask, mask.new_ones((ids.size(0), 1))), dim=-1)
        else:
            ids, past = state["input_ids"], None
        length += ids.size(1)
        output = model(
            ids,
            attention_mask=mask,
            attention_bias=bias,
            past_key_values=past,
            use_cache=True,
            last_logits_only=True,
        )
        assert output.logits is not None and output.attn_key_values is not None
        log_probs = F.log_softmax(output.logits[:, -1, :].float(), dim=-1)  # (B * beam, V)
        new_state: StateType = {}
        _flatten(output.attn_key_values, new_state)
        if mask is not None:
            new_state["attention_mask"] = mask
        if bias is not None:
            new_state["attention_bias"] = bias
        return log_probs, new_state

    state: StateType = {"input_ids": input_ids}
    if attention_mask is not None:
        state["attention_mask"] = attention_mask
    if attention_bias is not None:
        state["attention_bias"] = attention_bias
    start = input_ids.new_zeros((batch_size,))  # not fed to the model: the first step reads the prompt
    # Compiled blocks run eagerly here: every new sequence length would otherwise recompile them (17 s instead of
    # 0.02 s for 12 tokens of a tiny model on CPU), for a few single-token passes.
    with torch.compiler.set_stance("force_eager"):
        token_ids, scores = search.search(start, state, step)
    return OLMoGenerateOutput(token_ids=token_ids, scores=scores)
