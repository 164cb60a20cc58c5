"""Caption image files with a checkpoint, and draw where each word looked."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from captioning.config import Config
from captioning.data.images import load_image
from captioning.decoding import Decoded, decode
from captioning.errors import DataError
from captioning.models import Captioner
from captioning.vocab import Vocabulary


@dataclass
class CaptionResult:
    """The outcome for one image: a caption (with its attention) or an error message."""

    image: str
    caption: str | None = None
    words: list[str] | None = None
    alphas: torch.Tensor | None = None  # (T, L), one map per word
    cells: list[int] | None = None  # hard attention: the chosen cell per word
    figure: str | None = None
    gif: str | None = None
    error: str | None = None


def caption_files(
    paths: Sequence[str],
    model: Captioner,
    vocab: Vocabulary,
    cfg: Config,
    device: torch.device,
    batch_size: int = 16,
) -> Iterator[CaptionResult]:
    """Caption every readable file in ``paths``, in order; unreadable ones yield an error
    result (and never stop the others)."""
    model.eval()
    pending: list[tuple[str, torch.Tensor]] = []

    def flush() -> Iterator[CaptionResult]:
        images = torch.stack([tensor for _, tensor in pending]).to(device)
        with torch.no_grad():
            decoded: Decoded = decode(model.decoder, model.encoder(images), cfg.decode)
        for row, (path, _) in enumerate(pending):
            length = int(decoded.lengths[row])
            words = vocab.decode_tokens(decoded.tokens[row, :length].tolist())
            cells = None if decoded.cells is None else decoded.cells[row, :length].tolist()
            yield CaptionResult(
                image=path,
                caption=" ".join(words),
                words=words,
                alphas=decoded.alphas[row, :length].float().cpu(),
                cells=cells,
            )
        pending.clear()

    for path in paths:
        try:
            pending.append((path, model.encoder.transform(load_image(path))))
        except DataError as exc:
            yield from flush() if pending else ()
            yield CaptionResult(image=path, error=str(exc))
            continue
        if len(pending) == batch_size:
            yield from flush()
    if pending:
        yield from flush()


def figure_stem(path: str, used: set[str]) -> str:
    """A file-name stem for ``path`` that no earlier image took (photos often share names)."""
    stem = Path(path).stem or "image"
    candidate, n = stem, 1
    while candidate in used:
        n += 1
        candidate = f"{stem}_{n}"
    used.add(candidate)
    return candidate


def draw_attention(
    result: CaptionResult,
    grid: tuple[int, int],
    out_dir: str | Path,
    stem: str,
    smooth: bool = True,
    gif: bool = False,
) -> CaptionResult:
    """Write the per-word attention grid (and optionally a GIF) of a captioned image."""
    from captioning.viz import attention_gif, attention_grid_figure

    if not result.words:  # an empty caption has nothing to show
        return result
    image = load_image(result.image)
    out_dir = Path(out_dir)
    result.figure = str(
        attention_grid_figure(
            image,
            result.words,
            result.alphas,
            grid,
            out_dir / f"{stem}.png",
            smooth=smooth,
            chosen_cells=result.cells,
            title=result.caption,
        )
    )
    if gif:
        result.gif = str(
            attention_gif(
                image,
                result.words,
                result.alphas,
                grid,
                out_dir / f"{stem}.gif",
                smooth=smooth,
                chosen_cells=result.cells,
            )  # fmt: skip
        )
    return result
