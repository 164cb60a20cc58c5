"""The levers of attention that looks: a two-level encoder (a summary of the image beside an
earlier stage's grid), a halved output stride, a learned initial state, the maps' entropy
in the loss and the context-word term."""

import math

import pytest
import torch

from captioning.config import DecodeConfig, ModelConfig, load_config
from captioning.errors import ConfigError
from captioning.inference.decoding import decode
from captioning.models import build_model
from captioning.models.encoder import build_encoder, split_summary
from captioning.objectives.cross_entropy import attention_entropy, caption_loss

VOCAB = 30


def _model(**settings) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(
        encoder="mobilenet_v2",
        weights=None,
        image_size=64,
        attention_dim=16,
        embed_dim=16,
        hidden_dim=24,
        context_to_lstm=False,
        dropout=0.0,
        **settings,
    )
    return build_model(cfg, VOCAB).eval()


def _images(count: int = 2) -> torch.Tensor:
    return torch.rand(count, 3, 64, 64, generator=torch.Generator().manual_seed(1)) * 255


def test_the_summary_rides_after_the_cells_and_the_attention_never_sees_it():
    model = _model(drop_stages=5, summary="output")
    encoder = model.encoder
    # stride 16 at 64 px: a 4 x 4 grid of 96 channels, then 1,280 summary channels in 14 rows
    assert encoder.grid_shape == (4, 4) and encoder.out_channels == 96
    assert (encoder.summary_dim, encoder.summary_rows, encoder.num_rows) == (1280, 14, 30)
    grid = encoder.backbone(_images())
    assert grid.shape == (2, 30, 96)
    cells, summary = split_summary(grid, 14, 1280)
    # the summary is the dropped stages run on the grid's stage and averaged over their cells
    with torch.no_grad():
        x = (_images() - encoder.mean) / encoder.std
        for stage in encoder.stages:
            x = stage(x)
        expected = x
        for stage in encoder.summary_stages:
            expected = stage(expected)
    torch.testing.assert_close(cells, x.flatten(2).transpose(1, 2))
    torch.testing.assert_close(summary, expected.mean(dim=(2, 3)))
    assert torch.all(grid[:, -1, 1280 - 13 * 96 :] == 0)  # the last row's padding
    tokens = torch.randint(4, VOCAB, (2, 6))
    with torch.no_grad():
        before = model(None, tokens, grid=grid)
        changed = grid.clone()
        changed[:, 16:] = torch.randn_like(changed[:, 16:])  # another summary, same cells
        after = model(None, tokens, grid=changed)
    torch.testing.assert_close(before.alphas, after.alphas)  # where it looks: the cells alone
    assert before.alphas.shape == (2, 5, 16)
    assert not torch.allclose(before.logits, after.logits)  # what it says: the summary too


@pytest.mark.parametrize(
    "summary, gated", [("init", False), ("output", False), ("both", False), ("both", True)]
)
def test_a_summary_model_decodes_as_it_trains(summary, gated):
    """Beam search and greedy decoding carry the summary with each image's rows, and teacher
    forcing gives the step loop's numbers (the summary's gate too)."""
    model = _model(drop_stages=5, summary=summary, summary_gate=gated)
    features = model.encode(grid=model.encoder.backbone(_images(3)))
    tokens = torch.randint(4, VOCAB, (3, 7))
    with torch.no_grad():
        parallel = model.decoder(features, tokens)
        model.decoder.parallel = False
        stepped = model.decoder(features, tokens)
    torch.testing.assert_close(parallel.logits, stepped.logits, atol=1e-5, rtol=1e-4)
    greedy = decode(model.decoder, features, DecodeConfig(strategy="greedy", max_length=5))
    one_beam = decode(
        model.decoder, features, DecodeConfig(strategy="beam", beam_size=1, max_length=5)
    )
    assert greedy.tokens.tolist() == one_beam.tokens.tolist()
    beams = decode(model.decoder, features, DecodeConfig(strategy="beam", beam_size=3))
    assert beams.trace.alpha.shape[-1] == 16


def test_the_summarys_gate_turns_its_term_up_and_down_word_by_word():
    """Closed, the gate leaves the words as a model without the summary at the output says
    them; open, as the ungated model with the same weights; between, it trains."""
    gated = _model(drop_stages=5, summary="output", summary_gate=True)
    plain = _model(drop_stages=5, summary="output")
    plain.load_state_dict(
        {k: v for k, v in gated.state_dict().items() if "summary_gate" not in k}, strict=True
    )
    grid = gated.encoder.backbone(_images())
    tokens = torch.randint(4, VOCAB, (2, 6))
    gate = gated.decoder.summary_gate
    with torch.no_grad():
        gate.weight.zero_()
        gate.bias.fill_(40.0)  # open
        torch.testing.assert_close(
            gated(None, tokens, grid=grid).logits, plain(None, tokens, grid=grid).logits
        )
        gate.bias.fill_(-40.0)  # closed: another summary changes nothing
        other = grid.clone()
        other[:, 16:] = torch.randn_like(other[:, 16:])
        torch.testing.assert_close(
            gated(None, tokens, grid=grid).logits, gated(None, tokens, grid=other).logits
        )
        gate.bias.zero_()
    gated.train()
    gated(None, tokens, grid=grid).logits.logsumexp(-1).sum().backward()
    assert gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0


def test_a_learned_initial_state_knows_nothing_of_the_image():
    model = _model(drop_stages=5, summary="output", init_state="learned")
    features = model.encode(grid=model.encoder.backbone(_images()))
    state = model.decoder.init_state(features)
    assert torch.equal(state.h[0], state.h[1]) and torch.equal(state.c[0], state.c[1])
    assert not hasattr(model.decoder, "init_h")
    # it trains
    tokens = torch.randint(4, VOCAB, (2, 6))
    loss = model(None, tokens, grid=model.encoder.backbone(_images())).logits.logsumexp(-1).sum()
    loss.backward()
    assert model.decoder.initial_h.grad is not None and model.decoder.initial_h.grad.abs().sum() > 0


def backbone(name, output_stride=None):
    """A randomly initialised torchvision backbone for 64 px images."""
    return build_encoder(ModelConfig(encoder=name, image_size=64, output_stride=output_stride))


def test_output_stride_16_doubles_the_grid_with_the_same_weights():
    torch.manual_seed(0)
    native = backbone("mobilenet_v2")
    torch.manual_seed(0)
    finer = backbone("mobilenet_v2", output_stride=16)
    assert native.grid_shape == (2, 2) and finer.grid_shape == (4, 4)
    for (name, a), (_, b) in zip(native.state_dict().items(), finer.state_dict().items()):
        assert torch.equal(a, b), name
    depthwise = finer.stages[15].conv[1][0]
    assert depthwise.dilation == (2, 2) and depthwise.padding == (2, 2)
    assert finer.stages[14].conv[1][0].stride == (1, 1)
    # a ResNet downsamples on both paths of its block: both keep their resolution
    assert backbone("resnet18", output_stride=16).grid_shape == (4, 4)
    with pytest.raises(ConfigError, match="model.output_stride=8: mobilenet_v2's grid has stride"):
        backbone("mobilenet_v2", output_stride=8)
    assert backbone("mobilenet_v2", output_stride=32).grid_shape == (2, 2)
    # VGG-19 already ends at stride 16 (its last pool is left out); stride 8 would need its
    # fourth pool undone, which dilation cannot do
    assert backbone("vgg11", output_stride=16).grid_shape == (4, 4)
    with pytest.raises(ConfigError, match="last downsampling is a pooling layer"):
        backbone("vgg11", output_stride=8)


def test_the_entropy_term_adds_each_words_map_entropy():
    model = _model(drop_stages=5)
    tokens = torch.tensor([[1, 5, 6, 7, 2, 0], [1, 8, 9, 2, 0, 0]])
    with torch.no_grad():
        output = model(None, tokens, grid=model.encoder.backbone(_images()))
    targets = tokens[:, 1:]
    plain = caption_loss(output, targets, 0, penalty_weight=0.0)
    paying = caption_loss(output, targets, 0, penalty_weight=0.0, entropy_weight=0.5)
    mask = (targets != 0).float()
    entropy = attention_entropy(output.alphas, mask)  # (B,) nats a caption
    torch.testing.assert_close(paying.total - plain.total, 0.5 * entropy.mean())
    # an untrained model's maps are near even: close to ln 16 a word, over 4 and 3 words
    assert abs(float(plain.entropy) - 3.5 * math.log(16)) < 0.5
    assert float(plain.entropy) == pytest.approx(float(entropy.mean()))


def test_settings_that_cannot_work_together_are_refused(tmp_path):
    base = tmp_path / "c.yaml"
    base.write_text("model:\n  encoder: mobilenet_v2\n  weights: null\n")
    cases = {
        ("model.summary=both", "model.init_state=learned"): "model.init_state=learned keeps it",
        ("model.summary=output", "model.deep_output=false"): "set model.deep_output=true",
        ("model.summary=init", "model.encoder=small_cnn"): "the small CNN has none to spare",
        ("model.summary=init", "model.grid_layers=1"): "do not combine yet",
        ("model.summary=init", "model.summary_gate=true"): "model.summary=init sends none",
        ("model.output_stride=0",): "model.output_stride",
        ("train.attention_entropy_weight=-1",): "train.attention_entropy_weight",
        ("train.context_word_weight=1",): "set model.context_words=true",
        ("model.context_words=true", "model.attention=hard"): "model.attention=hard does not",
        (
            "model.context_words=true",
            "train.context_word_weight=1",
            "train.objective=scst",
        ): "train.objective=scst",
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(base, list(overrides))


@pytest.mark.parametrize("gated", [False, True])
def test_hard_attentions_exact_marginal_carries_the_summary(gated):
    """The marginal over cells adds the summary's output term once, outside the sum: the
    teacher-forced marginal equals the one decoding computes word by word."""
    from captioning.models.attention import HardContext

    model = _model(drop_stages=5, summary="both", attention="hard", summary_gate=gated)
    grid = model.encoder.backbone(_images())
    tokens = torch.randint(4, VOCAB, (2, 6))
    marginal = HardContext(mode="marginal")
    with torch.no_grad():
        forced = model(None, tokens, grid=grid, hard=marginal).target_log_probs  # (2, 5)
        features = model.encode(grid=grid)
        keys, state = model.decoder.prepare(features), model.decoder.init_state(features)
        stepped = []
        for t in range(5):
            out = model.decoder.step(tokens[:, t], state, features, keys, marginal)
            stepped.append(out.logits.gather(1, tokens[:, t + 1 : t + 2]).squeeze(1))
            state = out.state
    torch.testing.assert_close(torch.stack(stepped, dim=1), forced, atol=1e-5, rtol=1e-5)


def _tiled(**settings):
    cfg = ModelConfig(encoder="small_cnn", cnn_channels=[8, 16], image_size=48, **settings)
    torch.manual_seed(0)
    return build_encoder(cfg).eval()


def test_a_tiled_grids_cells_see_their_own_windows_only():
    """model.tiles: each cell's vector is the backbone run on its window alone (a square of
    tile_size px centred on the cell, zero past the edge after normalisation) and averaged;
    pixels change only the cells whose windows hold them."""
    encoder = _tiled(tiles=3, tile_size=24)  # cells of 16 px, windows of 24 centred on them
    assert (encoder.grid_shape, encoder.num_cells) == ((3, 3), 9)
    images = _images(2)[:, :, :48, :48]
    with torch.no_grad():
        grid = encoder(images)
        normalised = torch.nn.functional.pad((images - encoder.mean) / encoder.std, (4,) * 4)
        for row, top in enumerate((0, 16, 32)):  # the window of cell (row, col) starts 4
            for col, left in enumerate((0, 16, 32)):  # px before the cell, in the padding
                x = normalised[:, :, top : top + 24, left : left + 24]
                for stage in encoder.stages:
                    x = stage(x)
                torch.testing.assert_close(grid[:, 3 * row + col], x.mean(dim=(2, 3)))
        changed = images.clone()
        changed[:, :, 40:, 12:14] = 0  # in the windows of cells (2, 0) and (2, 1) only
        moved = (encoder(changed) - grid).abs().amax(dim=(0, 2)) > 1e-5
    assert moved.view(3, 3).nonzero().tolist() == [[2, 0], [2, 1]]
    assert _tiled(tiles=3).tile_size == 32  # twice a cell by default


def test_a_tiled_grid_has_its_own_cache_and_its_summary_is_the_whole_photos():
    from captioning.data.feature_cache import encoder_fingerprint

    fingerprints = {
        encoder_fingerprint(_tiled(**settings))
        for settings in ({}, {"tiles": 3}, {"tiles": 3, "tile_size": 24}, {"tiles": 2})
    }
    assert len(fingerprints) == 4
    model = _model(drop_stages=1, summary="output", tiles=2, tile_size=48)
    images = _images()
    with torch.no_grad():
        cells, summary = split_summary(
            model.encoder.backbone(images), model.encoder.summary_rows, 1280
        )
        photo = (images - model.encoder.mean) / model.encoder.std
        for stage in [*model.encoder.stages, *model.encoder.summary_stages]:
            photo = stage(photo)
        expected = photo.mean(dim=(2, 3))
        torch.testing.assert_close(summary, expected, atol=1e-4, rtol=1e-4)
        assert cells.shape == (2, 4, 320)
        features = model.encode(grid=model.encoder.backbone(images))
        beams = decode(model.decoder, features, DecodeConfig(beam_size=2, max_length=4))
    assert beams.trace.alpha.shape[-1] == 4  # the decoder attends over the 2 x 2 windows


def test_a_hypercolumn_cell_joins_the_later_stages_upsampled_to_its_place():
    model = _model(drop_stages=5, hypercolumn=True, summary="output")
    encoder = model.encoder
    # stride 16 at 64 px: 4 x 4 cells of 96 + 1,280 channels; the summary fits in one row
    assert encoder.grid_shape == (4, 4) and encoder.out_channels == 96 + 1280
    assert (encoder.summary_dim, encoder.summary_rows) == (1280, 1)
    images = _images()
    with torch.no_grad():
        cells, summary = split_summary(encoder.backbone(images), 1, 1280)
        x = (images - encoder.mean) / encoder.std
        for stage in encoder.stages:
            x = stage(x)
        top = x
        for stage in encoder.summary_stages:
            top = stage(top)
    assert top.shape[-2:] == (2, 2)  # the later stages' grid, half as fine
    mid, late = cells.split([96, 1280], dim=2)
    torch.testing.assert_close(mid, x.flatten(2).transpose(1, 2))
    # bilinear, half-pixel centres: a corner cell is its corner's late feature, an inner
    # cell 3/4 of the nearest and 1/4 of the next
    late = late.transpose(1, 2).reshape(2, 1280, 4, 4)
    torch.testing.assert_close(late[..., 0, 0], top[..., 0, 0])
    torch.testing.assert_close(late[..., 0, 1], 0.75 * top[..., 0, 0] + 0.25 * top[..., 0, 1])
    torch.testing.assert_close(summary, top.mean(dim=(2, 3)))
    features = model.encode(grid=encoder.backbone(images))
    with torch.no_grad():
        beams = decode(model.decoder, features, DecodeConfig(beam_size=2, max_length=4))
    assert beams.trace.alpha.shape[-1] == 16


def test_hypercolumns_have_their_own_cache_and_need_stages_left_out(tmp_path):
    from captioning.data.feature_cache import encoder_fingerprint

    plain, joined = (_model(drop_stages=5, hypercolumn=h).encoder for h in (False, True))
    assert encoder_fingerprint(plain) != encoder_fingerprint(joined)
    base = tmp_path / "c.yaml"
    base.write_text("model:\n  encoder: mobilenet_v2\n  weights: null\n")
    for other in ("model.drop_stages=0", "model.tiles=4"):
        with pytest.raises(ConfigError, match="model.hypercolumn joins the stages"):
            load_config(base, ["model.hypercolumn=true", "model.drop_stages=5", other])


def test_tiles_that_cannot_work_are_refused(tmp_path):
    base = tmp_path / "c.yaml"
    base.write_text("model:\n  encoder: mobilenet_v2\n  weights: null\n")
    cases = {
        ("model.tile_size=64",): "set model.tiles too",
        ("model.tiles=4", "model.grid_size=7"): "set model.grid_size=null",
        ("model.tiles=4", "model.tile_size=40"): "smaller than a cell .224 px / 4 tiles = 56",
        ("model.tiles=0",): "model.tiles",
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(base, list(overrides))


def test_the_context_word_term_reads_each_word_from_its_attended_context():
    model = _model(drop_stages=5, context_words=True)
    tokens = torch.tensor([[1, 5, 6, 7, 2, 0], [1, 8, 9, 2, 0, 0]])
    grid = model.encoder.backbone(_images())
    with torch.no_grad():
        output = model(None, tokens, grid=grid)
        model.decoder.parallel = False  # the step loop reads the same contexts
        by_step = model(None, tokens, grid=grid)
    torch.testing.assert_close(output.context_logits, by_step.context_logits)
    # each word's logits come from its map's average of the cells, before the gate
    cells, _ = model.decoder.split(model.encode(grid=grid))
    contexts = torch.einsum("btl,bld->btd", output.alphas, cells)
    torch.testing.assert_close(output.context_logits, model.decoder.context_words(contexts))
    targets = tokens[:, 1:]
    plain = caption_loss(output, targets, 0)
    paying = caption_loss(output, targets, 0, context_weight=0.5)
    mask = (targets != 0).float()
    nll = torch.nn.functional.cross_entropy(
        output.context_logits.flatten(0, 1), targets.flatten(), reduction="none"
    ).view_as(targets)
    torch.testing.assert_close(paying.total - plain.total, 0.5 * (nll * mask).sum(1).mean())
    assert float(plain.context_nll) == pytest.approx(float((nll * mask).sum() / mask.sum()))
    assert _model(drop_stages=5).decoder.context_words is None


def planted_words(
    generator: torch.Generator, cells: int, dim: int, words: int, batch: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grids of noise in which each caption's two words (ids 4 to ``words`` - 1, the smaller
    first) are written into one cell each (a one-hot of the word): grids (B, L, D), captions
    ``<start> w1 w2 <end>`` (B, 4) and the two words' cells (B, 2)."""
    chosen = torch.stack(
        [torch.randperm(words - 4, generator=generator)[:2] + 4 for _ in range(batch)]
    )
    chosen = chosen.sort(dim=1).values
    where = torch.stack([torch.randperm(cells, generator=generator)[:2] for _ in range(batch)])
    grid = 0.3 * torch.randn(batch, cells, dim, generator=generator)
    rows = torch.arange(batch)
    for k in range(2):
        grid[rows, where[:, k], chosen[:, k]] += 3.0
    tokens = torch.cat(
        [torch.ones(batch, 1, dtype=torch.long), chosen, torch.full((batch, 1), 2)], dim=1
    )
    return grid, tokens, where


def _words_in_cells(context_weight: float) -> float:
    """Four cells; each of a caption's two words (the smaller id first) is written into one
    cell (a one-hot of the word over noise), the other cells hold noise. A decoder trained
    for 300 steps with ``context_weight`` on the context-word term: the mean weight its maps
    put on the cell that holds their word."""
    from captioning.models.attention import AttentionSizes, build_attention
    from captioning.models.decoder import Decoder

    generator = torch.Generator().manual_seed(0)
    cells, dim, words, batch = 4, 16, 12, 64

    def sample() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return planted_words(generator, cells, dim, words, batch)

    torch.manual_seed(0)
    cfg = ModelConfig(attention_dim=16, hidden_dim=32, embed_dim=16)
    attention = build_attention(cfg, AttentionSizes(dim, 32, cells, (2, 2), dim))
    decoder = Decoder(words, dim, attention, 16, 32, dropout=0.0, context_words=True)
    optimiser = torch.optim.Adam(decoder.parameters(), lr=1e-2)
    for _ in range(300):
        grid, tokens, _ = sample()
        output = decoder(grid, tokens[:, :-1])
        loss = caption_loss(
            output, tokens[:, 1:], 0, penalty_weight=0.0, context_weight=context_weight
        )
        optimiser.zero_grad()
        loss.total.backward()
        optimiser.step()
    grid, tokens, where = sample()
    with torch.no_grad():
        alphas = decoder(grid, tokens[:, :-1]).alphas  # (B, 3, 4): word 1, word 2, end
    return float(alphas[:, :2].gather(2, where.unsqueeze(2)).mean())


def test_the_context_word_term_moves_each_words_map_onto_its_evidence():
    """The decoder's initial state sees the mean cell, so the captions can be learnt
    without looking far; with the term each word's map goes to the cell that holds it,
    further than the cross-entropy alone takes it."""
    paid, plain = _words_in_cells(1.0), _words_in_cells(0.0)
    assert paid > 0.9 and paid > plain + 0.05, (paid, plain)
