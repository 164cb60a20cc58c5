"""The training loop: run folder, exact resume, checkpoints, failures."""

import os
import pickle

import pytest
import torch

from captioning.checkpoint import FORMAT_VERSION, load_checkpoint, save_checkpoint
from captioning.cli import main
from captioning.config import load_config
from captioning.data.shapes import generate_shapes
from captioning.errors import CaptioningError, CheckpointError
from captioning.inference.caption import decode_dataset, load_model
from captioning.training import train as train_module
from captioning.training.step import TrainingError
from captioning.training.train import fit

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "test_tiny.yaml")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    generate_shapes(root, num_train=24, num_val=6, num_test=6, seed=0, image_size=48)
    return root


def tiny(shapes, *overrides):
    return load_config(CONFIG, [f"data.root={shapes}", *overrides])


def params(model_state):
    return {k: v.clone() for k, v in model_state.items()}


def test_fit_writes_the_run_folder(shapes, tmp_path):
    summary = fit(tiny(shapes, "train.figure_every_epoch=true"), out_dir=tmp_path / "run")
    run = tmp_path / "run"
    for name in ("config.yaml", "last.pt", "best.pt"):
        assert (run / name).is_file(), name
    assert list(run.glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (run / "figures").iterdir()) == ["epoch_001.png", "epoch_002.png"]
    assert summary["epochs"] == 2 and len(summary["history"]) == 2
    assert load_config(run / "config.yaml") == tiny(shapes, "train.figure_every_epoch=true")
    payload = load_checkpoint(run / "last.pt")
    assert payload["epoch"] == 2 and payload["step"] == 2 * 3  # 24 images / batch 8
    assert payload["vocab"][:4] == ["<pad>", "<start>", "<end>", "<unk>"]


def test_val_every_validates_every_nth_epoch_and_the_last(shapes, tmp_path, monkeypatch):
    """``train.val_every=2`` over 3 epochs validates after epochs 2 and 3 only; the epoch in
    between trains and saves last.pt, and the weights are those of validating every epoch.
    ``train.val_from=2`` validates epochs 2 and 3, with the scores of validating all three;
    a ``val_from`` past the end still validates the last epoch."""
    calls = []
    validate = train_module.validate

    def counting(*args, **kwargs):
        calls.append(1)
        return validate(*args, **kwargs)

    monkeypatch.setattr(train_module, "validate", counting)
    every = fit(tiny(shapes, "train.epochs=3"), out_dir=tmp_path / "every")
    assert len(calls) == 3
    calls.clear()
    sparse = fit(tiny(shapes, "train.epochs=3", "train.val_every=2"), out_dir=tmp_path / "sparse")
    assert len(calls) == 2
    assert ["val_exact_match" in h for h in sparse["history"]] == [False, True, True]
    assert sparse["best_epoch"] in (2, 3)
    assert every["history"][-1]["loss"] == sparse["history"][-1]["loss"]
    a, b = (
        load_checkpoint(tmp_path / "every" / "last.pt"),
        load_checkpoint(tmp_path / "sparse" / "last.pt"),
    )
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    calls.clear()
    late = fit(tiny(shapes, "train.epochs=3", "train.val_from=2"), out_dir=tmp_path / "late")
    assert len(calls) == 2
    assert ["val_exact_match" in h for h in late["history"]] == [False, True, True]
    # the validated epochs score as they did when every epoch was validated
    for epoch in (1, 2):
        assert late["history"][epoch]["val_CIDEr"] == every["history"][epoch]["val_CIDEr"]
    calls.clear()
    fit(tiny(shapes, "train.epochs=3", "train.val_from=5"), out_dir=tmp_path / "last_only")
    assert len(calls) == 1  # the last epoch always validates


def test_existing_run_is_not_overwritten(shapes, tmp_path):
    fit(tiny(shapes, "train.epochs=1"), out_dir=tmp_path / "run")
    with pytest.raises(CaptioningError, match="already holds a run"):
        fit(tiny(shapes, "train.epochs=1"), out_dir=tmp_path / "run")


RESUMED = {
    "soft": ["model.attention=soft"],
    "hard": ["model.attention=hard"],  # the paper's REINFORCE, with its baseline
    "hard-loo": ["model.attention=hard", "train.hard_estimator=reinforce_loo"],
    "hard-vimco": [
        "model.attention=hard",
        "train.hard_estimator=vimco",
        "train.semi_sampling=sample",
    ],
    "hard-gumbel": ["model.attention=hard", "train.hard_estimator=gumbel"],
    "hard-exact": [
        "model.attention=hard",
        "train.hard_estimator=exact",
        "model.context_to_lstm=false",
    ],
    "scst-greedy": ["train.objective=scst", "train.scst_samples=2"],
    "hard-scst-loo": [
        "model.attention=hard",
        "train.objective=scst",
        "train.scst_baseline=loo",
        "train.scst_samples=3",
    ],
}


# self-critical training decodes every batch and runs the Java tokenizer at every set-up
SLOW_TO_RESUME = ("scst-greedy", "hard-scst-loo")


@pytest.mark.parametrize(
    "variant",
    [pytest.param(v, marks=pytest.mark.slow) if v in SLOW_TO_RESUME else v for v in RESUMED],
)
def test_resume_is_exact(shapes, tmp_path, variant):
    settings = RESUMED[variant]
    straight = fit(tiny(shapes, *settings), out_dir=tmp_path / "straight")
    fit(tiny(shapes, *settings, "train.epochs=1"), out_dir=tmp_path / "half")
    resumed = fit(
        tiny(shapes, *settings),
        out_dir=tmp_path / "half",
        resume=str(tmp_path / "half" / "last.pt"),
    )
    a = load_checkpoint(tmp_path / "straight" / "last.pt")
    b = load_checkpoint(tmp_path / "half" / "last.pt")
    assert a["step"] == b["step"] == 6
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    assert a["objective"] == b["objective"]
    assert straight["history"][-1]["loss"] == resumed["history"][-1]["loss"]


def test_resume_refuses_a_different_model(shapes, tmp_path):
    fit(tiny(shapes, "train.epochs=1"), out_dir=tmp_path / "run")
    with pytest.raises(CheckpointError, match="model.hidden_dim"):
        fit(
            tiny(shapes, "model.hidden_dim=48"),
            out_dir=tmp_path / "run",
            resume=str(tmp_path / "run" / "last.pt"),
        )


@pytest.fixture(scope="module")
def one_epoch(shapes, tmp_path_factory):
    run = tmp_path_factory.mktemp("one_epoch")
    fit(tiny(shapes, "train.epochs=1"), out_dir=run)
    return run / "last.pt"


def test_resume_applies_safe_changes_and_refuses_the_others_by_name(shapes, one_epoch, tmp_path):
    with pytest.raises(CheckpointError) as caught:
        fit(
            tiny(shapes, "train.lr=0.01", "train.seed=4"),
            out_dir=tmp_path / "a",
            resume=str(one_epoch),
        )
    assert str(caught.value) == (
        f"{one_epoch}: train.lr is 0.003 in the checkpoint and 0.01 here; a resumed run keeps "
        f"it (start a new run to change it); also 1 more"
    )
    summary = fit(
        tiny(shapes, "train.epochs=3", "train.log_every=1", "decode.beam_size=2"),
        out_dir=tmp_path / "b",
        resume=str(one_epoch),
    )
    assert summary["epochs"] == 3 and load_checkpoint(tmp_path / "b" / "last.pt")["step"] == 9


def test_resume_needs_training_state_and_fitting_weights(shapes, one_epoch, tmp_path):
    payload = load_checkpoint(one_epoch)
    for key in ("optimizer", "rng"):
        save_checkpoint({k: v for k, v in payload.items() if k != key}, tmp_path / "cut.pt")
        with pytest.raises(CheckpointError, match=rf"holds no training state \({key} missing\)"):
            fit(tiny(shapes), out_dir=tmp_path / key, resume=str(tmp_path / "cut.pt"))
    save_checkpoint({**payload, "vocab": payload["vocab"] + ["zebra"]}, tmp_path / "vocab.pt")
    with pytest.raises(
        CheckpointError, match="its weights do not fit the model its config and vocabulary describe"
    ):
        fit(tiny(shapes), out_dir=tmp_path / "vocab", resume=str(tmp_path / "vocab.pt"))


@pytest.fixture
def init_weights(monkeypatch) -> dict:
    """The model's weights just after ``--init`` loaded a checkpoint into it (filled then)."""
    from captioning.training import setup

    loaded = {}
    real = setup.load_weights

    def spy(model, payload, path):
        real(model, payload, path)
        loaded.update({k: v.clone() for k, v in model.state_dict().items()})

    monkeypatch.setattr(setup, "load_weights", spy)
    return loaded


def test_init_starts_a_new_run_from_the_weights(shapes, one_epoch, tmp_path, init_weights):
    loaded = init_weights
    scst = ["train.objective=scst", "train.scst_samples=2", "train.epochs=1"]
    summary = fit(tiny(shapes, *scst), out_dir=tmp_path / "scst", init=str(one_epoch))
    initial = load_checkpoint(one_epoch)
    for key, value in initial["model"].items():
        assert torch.equal(loaded[key], value), key
    payload = load_checkpoint(tmp_path / "scst" / "last.pt")
    assert summary["epochs"] == 1 and payload["step"] == 3  # a fresh count, not 3 + 3
    assert payload["vocab"] == initial["vocab"]
    # a fresh optimiser: its moments count this run's 3 steps, not 3 + 3
    counts = {float(state["step"]) for state in payload["optimizer"]["state"].values()}
    assert counts == {3.0}, counts
    assert any(not torch.equal(v, initial["model"][k]) for k, v in payload["model"].items())


def test_hard_attention_starts_from_a_soft_models_weights(
    shapes, one_epoch, tmp_path, init_weights
):
    """Soft and hard attention score the cells with the same weights, so --init may swap one
    for the other; an attention with other weights (none) is refused by name."""
    initial = load_checkpoint(one_epoch)
    fit(
        tiny(shapes, "model.attention=hard", "train.epochs=1"),
        out_dir=tmp_path / "hard",
        init=str(one_epoch),
    )
    loaded = init_weights
    assert loaded.keys() == initial["model"].keys()
    assert all(torch.equal(loaded[k], v) for k, v in initial["model"].items())
    hard = load_checkpoint(tmp_path / "hard" / "last.pt")
    assert hard["config"]["model"]["attention"] == "hard"
    with pytest.raises(
        CheckpointError, match="model.attention is 'soft' in the checkpoint and 'none' here"
    ):
        fit(tiny(shapes, "model.attention=none"), out_dir=tmp_path / "none", init=str(one_epoch))


def test_a_hard_stage_starts_from_a_context_word_model_without_its_layer(
    shapes, tmp_path, init_weights
):
    """The context-word layer adds only a training term: a hard model (which has none) takes
    every other weight of a soft model trained with it; a model with the layer does not
    start from one without it."""
    words = ["model.context_words=true", "train.context_word_weight=1", "train.epochs=1"]
    fit(tiny(shapes, *words), out_dir=tmp_path / "soft")
    soft = load_checkpoint(tmp_path / "soft" / "last.pt")["model"]
    layer = {k for k in soft if k.startswith("decoder.context_words.")}
    assert layer == {"decoder.context_words.weight", "decoder.context_words.bias"}
    fit(
        tiny(shapes, "model.attention=hard", "train.epochs=1"),
        out_dir=tmp_path / "hard",
        init=str(tmp_path / "soft" / "last.pt"),
    )
    loaded = init_weights
    assert loaded.keys() == soft.keys() - layer
    assert all(torch.equal(loaded[k], soft[k]) for k in loaded)
    with pytest.raises(
        CheckpointError, match="model.context_words is False in the checkpoint and True here"
    ):
        fit(tiny(shapes, *words), out_dir=tmp_path / "b", init=str(tmp_path / "hard" / "last.pt"))


def test_a_hard_stage_starts_from_a_word_map_model_without_its_localiser(
    shapes, tmp_path, init_weights
):
    """The word localiser only trains beside the decoder: a hard model without one takes
    every other weight of a soft model trained with it."""
    maps = ["model.word_maps=true", "model.word_map_rank=8", "train.word_map_weight=1"]
    fit(tiny(shapes, *maps, "train.epochs=1"), out_dir=tmp_path / "soft")
    soft = load_checkpoint(tmp_path / "soft" / "last.pt")["model"]
    localiser = {k for k in soft if k.startswith("word_maps.")}
    assert localiser == {
        "word_maps.project.weight",
        "word_maps.project.bias",
        "word_maps.words.weight",
        "word_maps.bias.weight",
    }
    fit(
        tiny(shapes, "model.attention=hard", "train.epochs=1"),
        out_dir=tmp_path / "hard",
        init=str(tmp_path / "soft" / "last.pt"),
    )
    assert init_weights.keys() == soft.keys() - localiser
    assert all(torch.equal(init_weights[k], soft[k]) for k in init_weights)


def test_a_hard_stage_keeps_the_expected_word_score_and_trains_it_by_its_own_loss(
    shapes, tmp_path, init_weights
):
    """Hard attention with the expected words' maps in its score: it starts from a soft
    model that has them, every weight kept, and trains the localiser and the expected-word
    layer by their own losses beside REINFORCE."""
    words = [
        "model.word_maps=true",
        "model.word_map_rank=8",
        "model.word_attention=true",
        "train.expected_word_weight=1",
        "train.epochs=1",
    ]
    fit(tiny(shapes, *words), out_dir=tmp_path / "soft")
    soft = load_checkpoint(tmp_path / "soft" / "last.pt")["model"]
    assert {"word_maps.words.weight", "decoder.attention.score.expect.weight"} <= soft.keys()
    hard = fit(
        tiny(shapes, "model.attention=hard", *words),
        out_dir=tmp_path / "hard",
        init=str(tmp_path / "soft" / "last.pt"),
    )
    assert init_weights.keys() == soft.keys()
    epoch = hard["history"][-1]
    assert epoch["word_presence"] > 0 and epoch["expected_nll_per_token"] > 0
    assert "reward" in epoch  # REINFORCE's samples ran


def test_init_refuses_another_architecture_and_resume_in_one_line(
    shapes, one_epoch, tmp_path, capsys
):
    argv = [
        "train",
        "--config",
        CONFIG,
        "--set",
        f"data.root={shapes}",
        "--out",
        str(tmp_path / "run"),
        "--init",
        str(one_epoch),
    ]
    assert main([*argv, "--set", "model.hidden_dim=48"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.hidden_dim is 32 in the checkpoint and 48 here" in err[0]
    assert main([*argv, "--resume", str(one_epoch)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "give one of them" in err[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"vocab": [0, 1, 2, 3]}, "its vocabulary is not a list of words"),
        ({"model": torch.zeros(3)}, "its model is not a mapping of parameter names to tensors"),
        ({"config": [1, 2]}, "its config is not a mapping"),
        ({"epoch": -1}, "its epoch and step are not counts"),
        ({"vocab": ["a", "b"]}, "its config or vocabulary does not load (vocabulary must start"),
    ],
)
def test_malformed_checkpoints_get_one_line(shapes, one_epoch, tmp_path, capsys, change, problem):
    path = tmp_path / "bad.pt"
    save_checkpoint({**load_checkpoint(one_epoch), **change}, path)
    image = str(sorted((shapes / "images" / "test").glob("*.png"))[0])
    assert main(["caption", image, "--checkpoint", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and problem in err[0] and str(path) in err[0], err


def test_a_checkpoints_config_never_makes_the_loader_read_another_file(
    one_epoch, tmp_path, monkeypatch
):
    from captioning.models import encoder

    payload = load_checkpoint(one_epoch)
    elsewhere = tmp_path / "elsewhere.pt"
    torch.save({"stages.0.0.weight": torch.zeros(1)}, elsewhere)
    payload["config"]["model"]["weights"] = str(elsewhere)
    save_checkpoint(payload, tmp_path / "pointing.pt")

    def read(*args, **kwargs):
        raise AssertionError("the loader read model.weights")

    monkeypatch.setattr(encoder, "_load_small_cnn_weights", read)
    model, cfg, _ = load_model(tmp_path / "pointing.pt")
    assert cfg.model.weights is None
    for key, value in model.state_dict().items():
        assert torch.equal(value, payload["model"][key]), key


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_model_weights_that_would_run_code_are_refused_in_one_line(shapes, tmp_path, capsys):
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.pt"
    torch.save(_RunsCode(str(marker)), evil)
    code = main(
        [
            "train",
            "--config",
            CONFIG,
            "--set",
            f"data.root={shapes}",
            "--set",
            f"model.weights={evil}",
            "--out",
            str(tmp_path / "run"),
        ]
    )
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err
    assert "refused to load" in errors[0] and str(evil) in errors[0]
    assert not marker.exists()
    torch.save({"nothing": torch.zeros(1)}, evil)
    argv = [
        "train",
        "--config",
        CONFIG,
        "--set",
        f"data.root={shapes}",
        "--set",
        f"model.weights={evil}",
        "--out",
        str(tmp_path / "run"),
    ]
    assert main(argv) == 2
    assert "does not fit model.cnn_channels" in capsys.readouterr().err


def test_ctrl_c_during_a_checkpoint_write_finishes_the_write_then_stops(
    shapes, tmp_path, capsys, monkeypatch
):
    import signal

    from captioning import checkpoint

    real_save = torch.save

    def interrupted_save(obj, handle):  # Ctrl-C arrives in the middle of the write
        os.kill(os.getpid(), signal.SIGINT)
        real_save(obj, handle)

    monkeypatch.setattr(checkpoint.torch, "save", interrupted_save)
    # as a run that a script started with `command &`, which inherits Ctrl-C ignored: a
    # signal sent to it still stops it
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    run = tmp_path / "run"
    argv = ["train", "--config", CONFIG, "--set", f"data.root={shapes}", "--out", str(run)]
    try:
        code = main(argv)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "interrupted"
    assert load_checkpoint(run / "last.pt")["epoch"] == 1  # whole, and the run stopped
    assert not list(run.glob(".*.tmp"))
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    assert main([*argv, "--resume", str(run / "last.pt")]) == 0
    assert load_checkpoint(run / "last.pt")["epoch"] == 2


def test_a_run_folder_takes_one_training_at_a_time(shapes, tmp_path, caplog):
    from captioning.training.run_folder import lock_run_dir

    run = tmp_path / "run"
    run.mkdir()
    (run / ".last.pt.abc123.tmp").write_bytes(b"half a checkpoint")  # a write killed midway
    held = lock_run_dir(run)
    try:
        with pytest.raises(
            CaptioningError,
            match=rf"run folder {run} is in use by another "
            rf"training \(pid {os.getpid()}\)",
        ):
            fit(tiny(shapes, "train.epochs=1"), out_dir=run)
    finally:
        held.close()
    assert not (run / "config.yaml").exists()  # nothing of the refused run was written
    fit(tiny(shapes, "train.epochs=1"), out_dir=run)
    assert not list(run.glob(".*.tmp"))
    assert "a checkpoint write that never finished" in caplog.text


def test_a_diverged_model_skips_its_figure_and_keeps_training(shapes, tmp_path, caplog):
    from captioning.inference.caption import CaptionResult
    from captioning.training.train import _epoch_figure

    fit(tiny(shapes, "train.epochs=1"), out_dir=tmp_path / "run")
    model, cfg, vocab = load_model(tmp_path / "run" / "last.pt")
    for param in model.decoder.attention.parameters():
        param.data.fill_(float("nan"))

    from types import SimpleNamespace

    from captioning.data import CaptionDataset, load_splits

    run = SimpleNamespace(model=model, vocab=vocab, cfg=cfg, progress=SimpleNamespace(epoch=1))

    dataset = CaptionDataset(load_splits(cfg.data)["val"], vocab, model.encoder.transform)
    _, details = decode_dataset(model, dataset, cfg, torch.device("cpu"))
    decoded = details[dataset.records[0].image_id]
    assert not torch.isfinite(CaptionResult.from_decoded("x", decoded, vocab).alphas).all()
    _epoch_figure(run, dataset, details, tmp_path / "figures" / "epoch_001.png")
    assert "no attention figure for epoch 1: the weights are not finite" in caplog.text
    assert not (tmp_path / "figures").exists()


ATTENTION_VARIANTS = {
    "soft": [],
    "location": ["model.score=location"],
    "key-value": ["model.values=projected", "model.value_dim=24"],
    "multi-head": ["model.heads=4"],
    "local": ["model.attention=local", "model.local_sigma=1.5"],
    "grid-self-attention": ["model.grid_layers=1"],
}


@pytest.mark.parametrize("variant", ATTENTION_VARIANTS)
def test_checkpoint_rebuilds_its_own_model(shapes, tmp_path, variant):
    cfg = tiny(shapes, "train.epochs=1", *ATTENTION_VARIANTS[variant])
    fit(cfg, out_dir=tmp_path / "run")
    model, loaded_cfg, vocab = load_model(tmp_path / "run" / "best.pt")
    assert loaded_cfg == cfg and not model.training
    from captioning.data import CaptionDataset, load_splits

    records = load_splits(cfg.data)["val"]
    dataset = CaptionDataset(records, vocab, model.encoder.transform)
    first, _ = decode_dataset(model, dataset, cfg, torch.device("cpu"))
    again, _ = decode_dataset(
        load_model(tmp_path / "run" / "best.pt")[0], dataset, cfg, torch.device("cpu")
    )
    assert first == again and len(first) == 6


class Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def test_checkpoint_that_runs_code_is_refused(tmp_path):
    target = tmp_path / "pwned"
    exploit = Exploit()
    exploit.target = target
    path = tmp_path / "evil.pt"
    torch.save({"format_version": FORMAT_VERSION, "model": exploit}, path)
    with pytest.raises(CheckpointError, match="refused to load"):
        load_checkpoint(path)
    assert not target.exists()
    # plain unpickling would have run it: the test really builds an exploit
    pickle.loads(pickle.dumps(exploit))
    assert target.exists()


def test_checkpoint_format_checks(tmp_path):
    base = {"model": {}, "config": {}, "vocab": [], "epoch": 0, "step": 0}
    save_checkpoint(base, tmp_path / "ok.pt")
    assert load_checkpoint(tmp_path / "ok.pt")["format_version"] == FORMAT_VERSION
    torch.save({**base, "format_version": FORMAT_VERSION + 1}, tmp_path / "new.pt")
    with pytest.raises(CheckpointError, match="format version"):
        load_checkpoint(tmp_path / "new.pt")
    torch.save({"format_version": FORMAT_VERSION, "model": {}}, tmp_path / "partial.pt")
    with pytest.raises(CheckpointError, match="missing the key 'config'"):
        load_checkpoint(tmp_path / "partial.pt")
    (tmp_path / "text.pt").write_text("hello")
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        load_checkpoint(tmp_path / "text.pt")
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "absent.pt")
    with pytest.raises(TypeError, match="plain data"):
        save_checkpoint({**base, "model": torch.nn.Linear(2, 2)}, tmp_path / "module.pt")
    assert not (tmp_path / "module.pt").exists()
    assert not list(tmp_path.glob(".*.tmp"))  # the failed write left nothing behind


def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(shapes, tmp_path, monkeypatch):
    import captioning.objectives.cross_entropy as losses_module

    real_loss = losses_module.caption_loss
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        terms = real_loss(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 5:  # second step of epoch 2
            terms.total = terms.total * float("nan")
        return terms

    monkeypatch.setattr(losses_module, "caption_loss", poisoned)
    with pytest.raises(TrainingError, match="non-finite loss at step 5 \\(epoch 2\\)"):
        fit(tiny(shapes), out_dir=tmp_path / "run")
    assert load_checkpoint(tmp_path / "run" / "last.pt")["epoch"] == 1


def test_a_skipped_nonfinite_batch_leaves_the_baseline_untouched(shapes, tmp_path, monkeypatch):
    from captioning.objectives.hard_attention import HardAttentionObjective

    real_loss = HardAttentionObjective.loss
    rewards = []

    def poisoned(self, *args, **kwargs):
        terms = real_loss(self, *args, **kwargs)
        if len(rewards) == 1:  # the second step of the run
            terms.total = terms.total * float("nan")
            rewards.append(None)
        else:
            rewards.append(float(terms.reward))
        return terms

    monkeypatch.setattr(HardAttentionObjective, "loss", poisoned)
    settings = [
        "model.attention=hard",
        "train.semi_sampling_p=1",
        "train.epochs=1",
        "train.stop_on_nonfinite=false",
    ]
    summary = fit(tiny(shapes, *settings), out_dir=tmp_path / "run")
    assert summary["steps"] == 2 and len(rewards) == 3  # three batches, one skipped
    baseline = load_checkpoint(tmp_path / "run" / "last.pt")["objective"]["baseline"]
    assert baseline["value"] == pytest.approx(0.9 * rewards[0] + 0.1 * rewards[2], rel=1e-5)


def test_cli_train_and_one_line_errors(shapes, tmp_path, capsys):
    code = main(
        [
            "train",
            "--config",
            CONFIG,
            "--set",
            f"data.root={shapes}",
            "--set",
            "train.epochs=1",
            "--out",
            str(tmp_path / "cli"),
            "--quiet",
        ]
    )
    assert code == 0 and (tmp_path / "cli" / "best.pt").is_file()
    code = main(["train", "--config", CONFIG, "--set", "train.epoch=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        code == 2 and err[-1] == "error: unknown config key train.epoch; did you mean train.epochs?"
    )
    code = main(["train", "--config", CONFIG, "--set", f"data.root={tmp_path / 'nothing'}"])
    assert code == 2 and "captioning shapes --out" in capsys.readouterr().err


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_on_cpu(shapes, tmp_path, precision):
    summary = fit(
        tiny(shapes, f"train.precision={precision}", "train.epochs=1"), out_dir=tmp_path / precision
    )
    assert summary["steps"] == 3 and (tmp_path / precision / "best.pt").is_file()
    payload = load_checkpoint(tmp_path / precision / "last.pt")
    assert all(torch.isfinite(v).all() for v in payload["model"].values() if v.is_floating_point())


def test_check_data_cli_reports_bad_images_by_path(tmp_path, capsys):
    root = tmp_path / "shapes"
    generate_shapes(root, num_train=6, num_val=2, num_test=2, seed=0, image_size=48)
    assert main(["check-data", "--config", CONFIG, "--set", f"data.root={root}", "--quiet"]) == 0
    assert "all 10 images open cleanly" in capsys.readouterr().out
    broken = sorted((root / "images" / "train").glob("*.png"))[1]
    broken.write_bytes(broken.read_bytes()[:100])  # truncated
    assert main(["check-data", "--config", CONFIG, "--set", f"data.root={root}", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "1 of 10 images cannot be read" in out and str(broken) in out
    # training refuses by default, and says how to go on
    code = main(
        ["train", "--config", CONFIG, "--set", f"data.root={root}", "--out", str(tmp_path / "run")]
    )
    assert code == 2 and "data.on_bad_image=skip" in capsys.readouterr().err


def test_same_seed_same_weights_other_seed_differs(shapes, tmp_path):
    runs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        fit(tiny(shapes, "train.epochs=1", f"train.seed={seed}"), out_dir=tmp_path / name)
        runs[name] = load_checkpoint(tmp_path / name / "last.pt")["model"]
    assert all(torch.equal(runs["a"][k], runs["b"][k]) for k in runs["a"])
    assert not all(torch.equal(runs["a"][k], runs["c"][k]) for k in runs["a"])


def test_a_model_trains_its_localiser_on_each_images_reference_words(shapes, tmp_path):
    """``train.word_map_labels=image``: the whole training path looks up each batch's
    images in the training split, and the localiser's presence loss falls."""
    labels = [
        "model.word_maps=true",
        "model.word_map_rank=8",
        "train.word_map_weight=1",
        "train.word_map_labels=image",
        "train.epochs=2",
    ]
    history = fit(tiny(shapes, *labels), out_dir=tmp_path / "image")["history"]
    assert history[-1]["word_presence"] < history[0]["word_presence"]


def test_training_ties_the_localisers_categories_and_the_checkpoint_keeps_them(shapes, tmp_path):
    """``model.word_map_classes=categories``: the words a map sends to one category (here a
    user's file over the shipped map) share the class of the first of them in the
    vocabulary, a model rebuilt from its checkpoint alone has the same classes, and the
    localiser's presence loss falls."""
    from captioning.metrics.words import load_category_words
    from captioning.models.word_maps import category_classes

    words = tmp_path / "shapes.yaml"
    words.write_text("circle: figure\nsquare: figure\nred: colour\nblue: colour\n")
    tied = [
        "model.word_maps=true",
        "model.word_map_rank=8",
        "model.word_map_classes=categories",
        f"model.word_map_categories={words}",
        "model.word_attention=true",
        "model.word_attention_words=categories",
        "train.word_map_weight=1",
        "train.epochs=2",
    ]
    history = fit(tiny(shapes, *tied), out_dir=tmp_path / "tied")["history"]
    assert history[-1]["word_presence"] < history[0]["word_presence"]
    model, _, vocab = load_model(tmp_path / "tied" / "best.pt")
    classes = model.word_maps.classes
    assert torch.equal(classes, category_classes(vocab.itos, load_category_words(words)))
    circle, square = vocab.stoi["circle"], vocab.stoi["square"]
    assert classes[circle] == classes[square] == min(circle, square)
    assert classes[vocab.stoi["triangle"]] == vocab.stoi["triangle"]
    looked = model.decoder.attention.score.looked
    named = {"circle", "square", "red", "blue"}
    assert looked.tolist() == [float(w in named) for w in vocab.itos]


def test_training_keeps_the_memory_its_steps_free(shapes, tmp_path, monkeypatch):
    # fit sets the allocator before its first step (captioning.allocator; docs/speed.md)
    calls = []
    monkeypatch.setattr(train_module, "keep_freed_memory", lambda: calls.append("kept") or True)
    fit(tiny(shapes, "train.epochs=1"), out_dir=tmp_path / "run")
    assert calls == ["kept"]
