"""Data preparation: COCO and Karpathy's split file downloaded into the configs' layout, and
one's own photos and captions made into a COCO-style dataset."""

from captioning.prepare.coco import data_overrides, prepare_coco
from captioning.prepare.folder import FolderSummary, prepare_folder

__all__ = ["FolderSummary", "data_overrides", "prepare_coco", "prepare_folder"]
