"""Figures of where a model looks (matplotlib's object API only, never ``pyplot``; one
function per figure): :mod:`~captioning.figures.heatmaps`, a caption's per-word maps over the
photo (its docstring gives the conventions every figure follows);
:mod:`~captioning.figures.heads`, multi-head attention's grid of heads;
:mod:`~captioning.figures.gif`, a caption as an animated GIF; :mod:`~captioning.figures.trace`,
the figures of a caption's per-word record; :mod:`~captioning.figures.maps`, from a row of
weights to pixels; :mod:`~captioning.figures.common`, their shared settings and input checks.
"""
