"""OLMo's import path for beam search: ``from olmo.beam_search import BeamSearch, TopPSampler, ...``. The code is
:mod:`olmo.model.beams`."""

from .model.beams import (
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
