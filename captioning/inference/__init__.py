"""Inference: a checkpoint to a model, images to captions and their attention records
(:mod:`~captioning.inference.caption`), the decoders they go through (greedy, sampling and
batched beam search, :mod:`~captioning.inference.decoding`), and the consensus
nearest-neighbour baseline (:mod:`~captioning.inference.nearest`)."""
