"""tools.grid_probe: the localisation probe finds a planted object, and scores like the maps."""

import numpy as np
import pytest
import torch

from captioning.data.records import ImageRecord, ObjectAnnotation

from .conftest import load_tool

probe_tool = load_tool("grid_probe")


def test_log_sum_exp_pooling_lies_between_the_mean_and_the_maximum():
    scores = torch.tensor([[[0.0, 1.0], [2.0, -1.0], [4.0, 0.5]]])  # (1, 3 cells, 2)
    mean, peak = scores.mean(1), scores.amax(1)
    pooled = probe_tool.lse_pool(scores, r=5.0)
    assert torch.all(mean < pooled) and torch.all(pooled < peak)
    assert torch.allclose(probe_tool.lse_pool(scores, r=1e-4), mean, atol=1e-3)
    assert torch.allclose(probe_tool.lse_pool(scores, r=200.0), peak, atol=0.01)


def test_average_precision_of_a_ranking():
    labels = np.array([1, 0, 1, 0])
    assert probe_tool.average_precision(np.array([4.0, 3.0, 2.0, 1.0]), labels) == pytest.approx(
        (1 + 2 / 3) / 2
    )
    assert probe_tool.average_precision(np.array([4.0, 1.0, 3.0, 2.0]), labels) == 1.0


def _planted(photos, seed, cells=16, dim=12, classes=2):
    """Grids of noise where each present category adds its own direction to one cell."""
    generator = torch.Generator().manual_seed(seed)
    grids = torch.randn(photos, cells, dim, generator=generator)
    labels = (torch.rand(photos, classes, generator=generator) < 0.5).float()
    where = torch.randint(0, cells, (photos, classes), generator=generator)
    for c in range(classes):
        for i in torch.nonzero(labels[:, c]).flatten():
            grids[i, where[i, c], c] += 4.0  # category c lives in channel c of its cell
    return probe_tool.Photos(grids.to(torch.float16), labels), where


def test_the_probe_learns_where_a_category_is_from_image_labels_alone():
    train, _ = _planted(2000, seed=0)
    held, where = _planted(100, seed=1)
    probe = probe_tool.fit_probe(train, seed=0, epochs=10)
    maps = probe.maps(held.grids)  # (N, L, C)
    present = torch.nonzero(held.labels)
    peaks = maps[present[:, 0], :, present[:, 1]].argmax(1)
    assert (peaks == where[present[:, 0], present[:, 1]]).float().mean() > 0.9  # chance: 1 / 16
    assert probe_tool.mean_ap(probe, held) > 0.95
    # a probe that learnt nothing ranks at chance
    untrained = probe_tool.fit_probe(train, seed=0, epochs=0)
    assert probe_tool.mean_ap(untrained, held) < 0.8


def test_grounding_scores_a_named_boxed_category_against_the_baselines():
    """A 4 x 4 grid over an 800 x 800 photo: the probe's dog map peaks on the dog's box in the
    top-left corner, where the centre prior cannot point."""
    mean, std = torch.zeros(3), torch.ones(3)
    weight = torch.eye(3)[:, :2]  # cells' channel 0 says dog, channel 1 says cat
    probe = probe_tool.Probe(mean, std, weight, torch.zeros(2))
    grid = torch.zeros(1, 16, 3)
    grid[0, 0, 0] = 3.0  # the dog in the top-left cell
    # the cat is probed but not in the photo, the couch (a sofa) named but not probed: neither
    # counts
    record = ImageRecord(
        image_id=1,
        path="photo.jpg",
        split="test",
        captions=("a dog on a sofa", "a puppy sleeps"),
        width=800,
        height=800,
        objects=(
            ObjectAnnotation(1, (0.0, 0.0, 100.0, 100.0), "dog"),
            ObjectAnnotation(2, (600.0, 600.0, 200.0, 200.0), "couch"),
        ),
    )
    result = probe_tool.ground(probe, grid, [record], ["dog", "cat"], (4, 4))
    overall = result["overall"]
    assert overall["words"] == 1 and list(result["categories"]) == ["dog"]
    assert overall["probe"]["pointing"] == 1.0
    assert overall["centre"]["pointing"] == 0.0
    assert overall["probe"]["mass"] > overall["saliency"]["mass"] > overall["even"]["mass"]
    assert overall["even"]["mass"] == pytest.approx(0.25 / 16)  # a quarter of one cell
    # the references: "dog" and "puppy" name the boxed dog ("sofa" names the couch, whose
    # category is not probed), each scored with the dog's map
    references = result["references"]
    assert references["overall"]["words"] == 2 and references["unprobed_words"] == 1
    assert references["overall"]["probe"]["pointing"] == 1.0
    assert list(references["categories"]) == ["dog"]


def test_word_classes_give_each_word_its_own_map():
    """``--classes words``: "dog" and "puppy" are two classes, each scored with its own map
    against the dog's box, in the pairs and in the references."""
    probe = probe_tool.Probe(torch.zeros(2), torch.ones(2), torch.eye(2), torch.zeros(2))
    grid = torch.zeros(1, 16, 2)
    grid[0, 0, 0] = 3.0  # "dog" peaks in the top-left cell, on the dog
    grid[0, 15, 1] = 3.0  # "puppy" in the bottom-right one, off it
    record = ImageRecord(
        image_id=1,
        path="photo.jpg",
        split="test",
        captions=("a dog on a sofa", "a puppy sleeps"),
        width=800,
        height=800,
        objects=(ObjectAnnotation(1, (0.0, 0.0, 100.0, 100.0), "dog"),),
    )
    result = probe_tool.ground(probe, grid, [record], ["dog", "puppy"], (4, 4), "words")
    assert result["overall"]["words"] == 2 and result["overall"]["probe"]["pointing"] == 0.5
    assert result["references"]["overall"]["words"] == 2
    assert result["references"]["overall"]["probe"]["pointing"] == 0.5
    assert probe_tool.caption_categories(
        ["A puppy and a man"], {"puppy": "dog", "man": "person"}, "words"
    ) == {"puppy", "man"}


def test_a_missing_shared_folder_is_one_line_and_exit_status_2(tmp_path, capsys):
    assert probe_tool.main(["--shared", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--shared must name the shared folder" in err
    assert not (tmp_path / "out").exists()
