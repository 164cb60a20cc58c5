"""Training objectives, found by name: ``train.objective=xe`` (maximum likelihood of the
references: cross-entropy with the doubly stochastic penalty for soft or no attention,
:mod:`~captioning.objectives.cross_entropy`; the estimator of ``train.hard_estimator`` for hard
attention, :mod:`~captioning.objectives.hard_attention`) and ``scst`` (self-critical
training, :mod:`~captioning.objectives.self_critical`). Every one meets the
:class:`~captioning.objectives.base.Objective` protocol; :func:`register_objective` adds
another (docs/extending.md).
"""

from __future__ import annotations

from captioning.config import unknown_choice
from captioning.objectives.base import (
    OBJECTIVES,
    Batch,
    LossTerms,
    Objective,
    ObjectiveContext,
    register_objective,
)
from captioning.objectives.cross_entropy import CrossEntropyObjective, ImageWords
from captioning.objectives.hard_attention import HardAttentionObjective
from captioning.objectives.self_critical import SelfCriticalObjective

__all__ = [
    "OBJECTIVES",
    "Batch",
    "CrossEntropyObjective",
    "HardAttentionObjective",
    "LossTerms",
    "Objective",
    "ObjectiveContext",
    "SelfCriticalObjective",
    "build_objective",
    "register_objective",
]


def maximum_likelihood(context: ObjectiveContext) -> Objective:
    """``train.objective=xe``: the references' likelihood, by cross-entropy for soft (or no)
    attention and by hard attention's estimator for a hard model."""
    cfg, model = context.cfg, context.model
    if model.hard_attention:
        cells = model.grid_shape[0] * model.grid_shape[1]
        return HardAttentionObjective(
            cfg, cells, context.device, cfg.train.precision, context.world, image_words(context)
        )
    return CrossEntropyObjective(
        cfg.train.doubly_stochastic_weight,
        context.device,
        cfg.train.precision,
        label_smoothing=cfg.train.label_smoothing,
        entropy_weight=cfg.train.attention_entropy_weight,
        context_weight=cfg.train.context_word_weight,
        map_weight=cfg.train.word_map_weight,
        expected_weight=cfg.train.expected_word_weight,
        image_words=image_words(context),
    )


def image_words(context: ObjectiveContext) -> ImageWords | None:
    """The localiser's image-level labels when ``train.word_map_labels=image`` asks for
    them, from the training split's references."""
    if context.cfg.train.word_map_labels != "image":
        return None
    if context.vocab is None or not context.train_records:
        raise ValueError("train.word_map_labels=image needs the training split and vocabulary")
    return ImageWords.from_records(context.train_records, context.vocab)


register_objective("xe", maximum_likelihood)


def build_objective(context: ObjectiveContext) -> Objective:
    """The objective ``context.cfg.train.objective`` names, built for ``context``."""
    name = context.cfg.train.objective
    if name not in OBJECTIVES:
        raise unknown_choice("train.objective", name, OBJECTIVES, "objectives.register_objective")
    return OBJECTIVES[name](context)
