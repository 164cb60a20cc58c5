"""Figures of where a model looks: per-word attention heatmaps over the photo, multi-head
grids and GIFs (:mod:`~captioning.figures.heatmaps`; matplotlib only, one function per
figure, never ``plt.show()``)."""
