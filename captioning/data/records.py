"""The one record type that every dataset reader produces."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ObjectAnnotation:
    """One annotated object (a COCO instance).

    Args:
        id: the instance annotation id.
        bbox: ``(x, y, width, height)`` in pixels of the original image.
        category: the category name (``dog``; for shapes the shape, ``circle``).
        attributes: extra fields of the annotation (shapes: ``color`` and ``size``).
    """

    id: int
    bbox: tuple[float, float, float, float]
    category: str
    attributes: dict[str, str] = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class ImageRecord:
    """An image with its reference captions.

    Args:
        image_id: the dataset's id of the image (COCO ``id``, Karpathy ``cocoid``/``imgid``).
        path: path of the image file.
        split: ``train``, ``val`` or ``test``.
        captions: the raw reference captions.
        width, height: image size in pixels when the annotation file gives it.
        objects: instance annotations, when an instances file was read.
    """

    image_id: int
    path: str
    split: str
    captions: tuple[str, ...]
    width: int | None = None
    height: int | None = None
    objects: tuple[ObjectAnnotation, ...] = ()
