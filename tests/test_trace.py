"""The per-word attention record: its operations keep every field, a subclass's too, and a
field that only an attention module and this test know reaches the JSON of the Python API,
the ``caption`` verb and the web demo unchanged, through greedy decoding and beam search."""

import json
from dataclasses import dataclass, replace

import pytest
import torch

import captioning
import captioning.models.attention as attention_module
from captioning.cli import main
from captioning.models.attention import EXPECTATION, SoftAttention
from captioning.models.trace import AttentionTrace, TraceLayout, json_numbers
from captioning.serve.app import ServeSettings
from captioning.serve.server import BackgroundServer

from .test_serve import LIMIT
from .test_serve import caption as serve_caption


@dataclass(frozen=True, eq=False)
class GlanceTrace(AttentionTrace):
    """The record with a field the project does not know: each word's largest weight."""

    glance: torch.Tensor | None = None  # (N,)


class GlancingAttention(SoftAttention):
    """Soft attention that also fills ``glance``."""

    def forward(self, features, keys, query, hard=EXPECTATION):
        out = super().forward(features, keys, query, hard)
        glance = out.alpha.max(dim=1).values  # (B,)
        return replace(out, trace=GlanceTrace(out.alpha, glance=glance))


def _trace(rows: int = 6) -> GlanceTrace:
    g = torch.Generator().manual_seed(0)
    alpha = torch.softmax(torch.randn(rows, 4, generator=g), dim=1)  # (N, L)
    cell = torch.arange(rows) % 4  # (N,)
    return GlanceTrace(alpha, cell=cell, glance=alpha.max(dim=1).values)


def test_every_operation_keeps_every_field_and_leaves_absent_ones_none():
    steps = [_trace(), _trace(rows=6)]
    steps[1] = steps[1].map(lambda value: value.flip(0))  # another step: rows reversed
    stacked = AttentionTrace.stack(steps, dim=1)  # (6, 2, ...)
    assert isinstance(stacked, GlanceTrace) and stacked.heads is None and stacked.centre is None
    assert stacked.alpha.shape == (6, 2, 4) and stacked.glance.shape == (6, 2)
    assert torch.equal(stacked.glance[:, 1], steps[0].glance.flip(0))
    assert stacked.cell[:, 1].tolist() == [1, 0, 3, 2, 1, 0]
    grouped = steps[0].unflatten(0, (3, 2))  # (3, 2, ...): 3 images, 2 beams
    picked = grouped[torch.tensor([[0], [2]]), torch.tensor([[1, 1], [0, 1]])]  # (2, 2, ...)
    assert torch.equal(picked.glance, steps[0].glance[torch.tensor([[1, 1], [4, 5]])])
    assert torch.equal(picked.cell, torch.tensor([[1, 1], [0, 1]]))
    words = stacked[2, :1]  # one image, its first word
    assert words.cell.tolist() == [2] and words.glance.shape == (1,)
    doubled = steps[0].map(lambda value: value.double() if value.is_floating_point() else value)
    portable = doubled.portable()
    assert doubled.glance.dtype == torch.float64
    assert portable.glance.dtype == torch.float32 and portable.cell.dtype == torch.long


def test_a_layout_packs_every_field_into_one_tensor_and_back():
    trace = _trace()
    layout = TraceLayout.of(trace)
    assert layout.width == 4 + 1 + 1  # alpha, cell, glance
    packed = layout.pack(trace)  # (6, 6)
    assert packed.shape == (6, 6) and packed.dtype == torch.float32
    moved = packed.view(3, 2, 6).flip(1)  # rows moved around as one tensor, (3, 2, W)
    back = layout.unpack(moved)
    assert isinstance(back, GlanceTrace) and back.heads is None and back.centre is None
    assert back.cell.dtype == torch.long and back.cell.tolist() == [[1, 0], [3, 2], [1, 0]]
    assert torch.equal(back.alpha, trace.alpha.view(3, 2, 4).flip(1))
    assert torch.equal(back.glance, trace.glance.view(3, 2).flip(1))
    plain = AttentionTrace(trace.alpha)
    assert TraceLayout.of(plain).pack(plain) is plain.alpha  # a plain map costs nothing


def test_the_json_names_every_field_and_shows_maps_on_the_grid():
    trace = _trace(2)
    trace = replace(trace, alpha=torch.tensor([[0.1, 0.2, 0.3, 0.4], [float("nan"), 0, 0, 1]]))
    data = trace.to_json((2, 2), decimals=1)
    assert data == {
        "attention": [[[0.1, 0.2], [0.3, 0.4]], [[None, 0.0], [0.0, 1.0]]],
        "cells": [0, 1],
        "heads": None,
        "centres": None,
        "glance": json_numbers(trace.glance, 1),
    }
    assert list(trace.to_json((2, 2), optional_only=True)) == [
        "cells",
        "heads",
        "centres",
        "glance",
    ]
    assert GlanceTrace.public_names() == ("attention", "cells", "heads", "centres", "glance")
    assert trace.shown("attention", (2, 2)).shape == (2, 2, 2)
    assert trace.shown("attention", None).shape == (2, 4) and trace.shown("heads", None) is None
    with pytest.raises(AttributeError):
        trace.shown("alpha", (2, 2))


def _glances(data: dict) -> list[float]:
    """Each word's largest weight, read off its map in the JSON."""
    return [max(max(row) for row in word_map) for word_map in data["attention"]]


@pytest.mark.parametrize("beam_size", [1, 3])
def test_a_new_field_reaches_the_json_with_no_edit_in_between(
    tiny_checkpoint, tiny_shapes, monkeypatch, tmp_path, capsys, beam_size
):
    """Only the attention module and the record's subclass know ``glance``: the decoder,
    decoding, the results, the drawing and the three JSON answers carry it as it is."""
    monkeypatch.setattr(attention_module, "SoftAttention", GlancingAttention)
    images = sorted(str(p) for p in (tiny_shapes / "images" / "test").glob("*.png"))[:2]
    model = captioning.load(tiny_checkpoint, device="cpu")
    assert isinstance(model.model.decoder.attention, GlancingAttention)

    results = model.caption(images, beam_size=beam_size)
    for result in results:
        data = json.loads(json.dumps(result.to_dict()))
        assert len(data["glance"]) == len(data["words"]) > 0
        assert data["glance"] == _glances(data)  # the largest of each word's weights
        torch.testing.assert_close(result.glance, result.alphas.flatten(1).max(dim=1).values)
        assert {"glance", "cells", "heads", "centres"} <= set(dir(result))

    figures = tmp_path / "figures"
    argv = [
        "caption",
        *images,
        "--checkpoint",
        str(tiny_checkpoint),
        "--json",
        "--beam-size",
        str(beam_size),
        "--attention-dir",
        str(figures),
    ]
    assert main(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["glance"] for r in records] == [r.to_dict()["glance"] for r in results]
    assert all((figures / f"{p.rsplit('/', 1)[1][:-4]}.png").is_file() for p in images)

    with BackgroundServer(model, ServeSettings(max_upload_bytes=LIMIT)) as url:
        status, answer = serve_caption(url, images[0], beam_size=beam_size)
    assert status == 200
    assert (
        answer["glance"]
        == json.loads(json.dumps(model.caption(images[0], beam_size=beam_size).to_dict()))["glance"]
    )
    assert answer["glance"] == _glances(answer)
