"""OLMo's import path for beam search: ``from olmo.beam_search import BeamSearch, TopPSampler, ...``. The code is
:mod:`olmo.model.beam_search`."""

from .model.beam_search import (
    BeamSearch,
    Constraint,
    ConstraintStateType,
    DeterministicSampler,
    FinalSequenceScorer,
    GumbelSampler,
    LengthNormalizedSequenceLogProbabilityScorer,
    MultinomialSampler,
    RepeatedNGramBlockingConstraint,
    Sampler,
    SequenceLogProbabilityScorer,
    StateType,
    StepFunctionType,
    StepFunctionTypeNoTimestep,
    StepFunctionTypeWithTimestep,
    TopKSampler,
    TopPSampler,
)

__all__ = [
    "BeamSearch",
    "Constraint",
    "ConstraintStateType",
    "DeterministicSampler",
    "FinalSequenceScorer",
    "GumbelSampler",
    "LengthNormalizedSequenceLogProbabilityScorer",
    "MultinomialSampler",
    "RepeatedNGramBlockingConstraint",
    "Sampler",
    "SequenceLogProbabilityScorer",
    "StateType",
    "StepFunctionType",
    "StepFunctionTypeNoTimestep",
    "StepFunctionTypeWithTimestep",
    "TopKSampler",
    "TopPSampler",
]
