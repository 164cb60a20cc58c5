"""Data: readers (COCO, Karpathy, shapes), records, Dataset, collate and sampler."""

from captioning.data.build import build_vocabulary, drop_bad_images, load_splits
from captioning.data.dataset import CaptionBatchSampler, CaptionDataset, collate
from captioning.data.records import ImageRecord, ObjectAnnotation

__all__ = [
    "CaptionBatchSampler",
    "CaptionDataset",
    "ImageRecord",
    "ObjectAnnotation",
    "build_vocabulary",
    "collate",
    "drop_bad_images",
    "load_splits",
]
