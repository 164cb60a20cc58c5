"""The Python API: ``captioning.load(checkpoint).caption(image)`` for every input kind, on
the same code path as the ``caption`` verb."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure
from PIL import Image

import captioning
from captioning.cli import main
from captioning.data.images import load_image
from captioning.errors import ConfigError, DataError
from captioning.models.trace import AttentionTrace


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return captioning.load(tiny_checkpoint, device="cpu")


@pytest.fixture(scope="module")
def images(tiny_shapes):
    return sorted(str(p) for p in (tiny_shapes / "images" / "test").glob("*.png"))[:3]


def test_the_readme_example(model, images):
    result = model.caption(images[0], beam_size=3)
    rows, cols = model.grid_shape
    assert result.caption == " ".join(result.words) and result.words
    assert result.alphas.shape == (len(result.words), rows, cols)
    torch.testing.assert_close(result.alphas.sum(dim=(1, 2)), torch.ones(len(result.words)))
    figure = result.plot()
    assert isinstance(figure, Figure) and len(figure.axes) == 1 + len(result.words)
    assert result._repr_png_().startswith(b"\x89PNG")
    assert result.source == images[0] and result.image.size == (48, 48)


def test_every_input_kind_gives_the_same_caption(model, images):
    path = images[0]
    picture = load_image(path)
    pixels = np.asarray(picture)  # (H, W, 3) uint8
    as_uint8 = torch.from_numpy(pixels.copy()).permute(2, 0, 1)  # (3, H, W)
    expected = model.caption(path)
    for item in (picture, pixels, as_uint8, as_uint8.float() / 255, picture.convert("RGBA")):
        result = model.caption(item)
        assert result.words == expected.words
        torch.testing.assert_close(result.alphas, expected.alphas)


def test_a_list_or_a_batch_tensor_gives_a_list_in_order(model, images):
    one_by_one = [model.caption(path).caption for path in images]
    assert [r.caption for r in model.caption(images)] == one_by_one
    assert [r.caption for r in model.caption(tuple(images), batch_size=2)] == one_by_one
    batch = torch.stack([torch.from_numpy(np.asarray(load_image(p)).copy()) for p in images])
    results = model.caption(batch.permute(0, 3, 1, 2))  # (B, 3, H, W)
    assert [r.caption for r in results] == one_by_one


def test_the_caption_verb_goes_the_same_way(model, images, tmp_path, capsys):
    assert (
        main(
            [
                "caption",
                *images,
                "--checkpoint",
                str(model.checkpoint),
                "--json",
                "--beam-size",
                "2",
                "--attention-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["caption"] for r in records] == [
        r.caption for r in model.caption(images, beam_size=2)
    ]
    assert all((tmp_path / f"{r['image'].rsplit('/', 1)[1][:-4]}.png").is_file() for r in records)


def test_bad_inputs_are_one_line_errors(model, images, tmp_path):
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    with pytest.raises(DataError, match=r"notes.png: not a JPEG, PNG, WebP, GIF, BMP or TIFF"):
        model.caption(str(text))
    with pytest.raises(DataError, match=r"a\\0b.png: the path holds a NUL byte; give the"):
        model.caption(f"{tmp_path}/a\0b.png")
    for shape in [(8, 8, 5), (8, 8, 2), (0, 8, 3), (8, 8, 3, 1)]:
        with pytest.raises(DataError, match=r"^an image array must be uint8 \(H, W\), \(H, W, 3\)"):
            model.caption(np.zeros(shape, np.uint8))
    with pytest.raises(DataError, match=r"an image tensor must be \(3, H, W\)"):
        model.caption(torch.zeros(3, 0, 8))
    with pytest.raises(DataError, match="cannot caption a int: give a file path"):
        model.caption(3)
    with pytest.raises(DataError, match=r"an image tensor must be \(3, H, W\)"):
        model.caption(torch.zeros(5, 8, 8))
    with pytest.raises(DataError, match="more than data.max_image_pixels"):
        model.caption(Image.new("L", (9000, 8000)))
    # caption_each keeps going: the bad input's failure comes in its place
    items = list(model.caption_each([images[0], str(text), images[1]]))
    assert [type(item).__name__ for item in items] == ["Caption", "Failed", "Caption"]
    assert items[1].source == str(text) and "not a JPEG" in items[1].error


def test_hard_attention_reports_its_chosen_cells(tiny_hard_checkpoint, images):
    hard = captioning.load(tiny_hard_checkpoint, device="cpu")
    assert hard.hard_attention
    result = hard.caption(images[0], hard_context="argmax")
    rows, cols = hard.grid_shape
    assert len(result.cells) == len(result.words)
    flat = result.alphas.flatten(1)  # (T, rows * cols)
    assert result.cells == flat.argmax(dim=1).tolist()
    assert result.to_dict()["cells"] == result.cells and result.grid == (rows, cols)


def test_to_dict_is_json(model, images):
    data = json.loads(json.dumps(model.caption(images[0]).to_dict()))
    assert set(data) == {"caption", "words", "attention", "grid", "cells", "heads", "centres"}
    assert data["heads"] is None and data["centres"] is None
    assert len(data["attention"]) == len(data["words"])
    assert [len(data["attention"][0]), len(data["attention"][0][0])] == data["grid"]


def test_importing_the_package_does_not_import_torch():
    code = "import sys, captioning; print('torch' in sys.modules, callable(captioning.load))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


def test_a_notebook_shows_the_result_and_its_plot(model, images):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        result = model.caption(images[0])
        for shown in (result, result.plot()):
            data, _ = shell.display_formatter.format(shown)
            assert data["image/png"][:4] == b"\x89PNG"
    finally:
        InteractiveShell.clear_instance()


def test_a_diverged_models_nan_is_null_in_json():
    alphas = torch.full((1, 4), 0.25)  # (T, L)
    alphas[0, 3] = float("nan")
    result = captioning.Caption(
        "red", ["red"], AttentionTrace(alphas), "x.png", grid=(2, 2), image=Image.new("RGB", (4, 4))
    )
    data = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert data["attention"] == [[[0.25, 0.25], [0.25, None]]] and data["grid"] == [2, 2]


@pytest.fixture(scope="module")
def local(tiny_local_checkpoint):
    return captioning.load(tiny_local_checkpoint, device="cpu")


@pytest.fixture(scope="module")
def multi_head(tiny_heads_checkpoint):
    return captioning.load(tiny_heads_checkpoint, device="cpu")


def test_a_multi_head_model_reports_each_heads_maps(multi_head, images):
    assert multi_head.heads == 2
    rows, cols = multi_head.grid_shape
    for beam_size in (1, 3):
        result = multi_head.caption(images[0], beam_size=beam_size)
        assert result.words and result.centres is None
        assert result.heads.shape == (len(result.words), 2, rows, cols)
        torch.testing.assert_close(result.heads.mean(dim=1), result.alphas)
        torch.testing.assert_close(result.heads.sum(dim=(2, 3)), torch.ones(len(result.words), 2))
    data = json.loads(json.dumps(result.to_dict()))
    assert torch.tensor(data["heads"]).shape == result.heads.shape and data["centres"] is None
    torch.testing.assert_close(torch.tensor(data["heads"]), result.heads, atol=1e-4, rtol=0)
    figure = result.plot_heads()  # one row per head and the mean, one column per word
    assert isinstance(figure, Figure) and len(figure.axes) == 3 * len(result.words)


def test_a_local_model_reports_its_centres(local, images):
    assert local.heads == 1
    rows, cols = local.grid_shape
    result = local.caption(images[0], beam_size=2)
    assert result.words and result.heads is None
    assert result.centres.shape == (len(result.words), 2)
    assert bool((result.centres >= 0).all()) and bool((result.centres[:, 0] <= rows).all())
    assert bool((result.centres[:, 1] <= cols).all())
    data = json.loads(json.dumps(result.to_dict()))
    torch.testing.assert_close(torch.tensor(data["centres"]), result.centres, atol=1e-4, rtol=0)
    figure = result.plot()  # the centre of each word is crossed on its panel
    crosses = [ax.lines[0].get_data() for ax in figure.axes[1:]]
    height, width = result.image.height, result.image.width
    expected = [
        [c * width / cols - 0.5, r * height / rows - 0.5] for r, c in result.centres.tolist()
    ]
    drawn = [[float(x[0]), float(y[0])] for x, y in crosses]
    np.testing.assert_allclose(drawn, expected, rtol=1e-6)
    with pytest.raises(ConfigError, match="single attention head"):
        result.plot_heads()


@pytest.mark.slow  # every head's figure for two models (the plain caption verb stays)
def test_the_caption_verb_writes_heads_figures_and_json(
    multi_head, local, images, tmp_path, capsys
):
    out = tmp_path / "att"
    assert (
        main(
            [
                "caption",
                *images[:2],
                "--checkpoint",
                str(multi_head.checkpoint),
                "--json",
                "--attention-dir",
                str(out),
                "--per-head",
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for record, path in zip(records, images):
        stem = path.rsplit("/", 1)[1][:-4]
        assert record["heads_figure"] == str(out / f"{stem}_heads.png")
        with Image.open(record["heads_figure"]) as png:
            assert png.format == "PNG" and png.height > png.width / len(record["caption"])
        expected = multi_head.caption(path)
        torch.testing.assert_close(torch.tensor(record["heads"]), expected.heads, atol=1e-4, rtol=0)
        assert record["centres"] is None
    assert main(["caption", images[0], "--checkpoint", str(local.checkpoint), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    expected = local.caption(images[0])
    assert record["heads"] is None and len(record["centres"]) == len(expected.words)
    torch.testing.assert_close(torch.tensor(record["centres"]), expected.centres, atol=1e-4, rtol=0)


def test_per_head_on_a_single_head_model_is_one_line(local, images, tmp_path, capsys):
    for argv, message in (
        (
            ["--attention-dir", str(tmp_path), "--per-head"],
            "has a single head: give a multi-head checkpoint (trained with --set model.heads=H",
        ),
        (["--per-head"], "--per-head writes its figures into --attention-dir"),
    ):
        code = main(["caption", images[0], "--checkpoint", str(local.checkpoint), *argv])
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("error: --per-head")
        assert message in err[0], err
        assert not captured.out and not list(tmp_path.iterdir())


@pytest.mark.parametrize(("block", "unfoldable"), [("plain", 0), ("preact", 3)])
def test_load_folds_a_frozen_encoders_batch_norms(tiny_shapes, tmp_path, block, unfoldable):
    """``captioning.load`` only captions, so a frozen encoder's BatchNorms that follow a
    convolution are folded into it (a pre-activation block's come before its ReLU and
    convolution, and the one after its sum follows no convolution: they stay); the grid, and
    so the caption, are those of the network as trained."""
    from torch import nn

    from captioning.inference.caption import caption_batch, load_model
    from tests.conftest import _tiny_run

    checkpoint = _tiny_run(
        tiny_shapes, tmp_path / "frozen", "model.fine_tune=none", f"model.cnn_block={block}"
    )
    model = captioning.load(checkpoint, device="cpu")
    trained, cfg, _ = load_model(checkpoint)
    assert any(isinstance(m, nn.BatchNorm2d) for m in trained.encoder.modules())
    left = sum(isinstance(m, nn.BatchNorm2d) for m in model.model.encoder.modules())
    assert left == unfoldable
    image = next((tiny_shapes / "images").rglob("*.png"))
    inputs = model.prepare(load_image(image))[None]
    with torch.no_grad():
        folded = model.model.encode(inputs)
        unfolded = trained.encode(inputs)
    torch.testing.assert_close(folded, unfolded, rtol=1e-4, atol=1e-4)
    ours = caption_batch(model.model, cfg.decode, "fp32", images=inputs)
    theirs = caption_batch(trained, cfg.decode, "fp32", images=inputs)
    assert torch.equal(ours.tokens, theirs.tokens)
