"""Hard attention's gradient estimators against the exact gradient, per unit of wall time.

    python -m tools.estimator_variance --checkpoint runs/hard_mid/last.pt \
        [--batch 32] [--repeats 20] [--samples 4] [--baseline-batches 20] [--out runs/estimators] \
        [--results results/estimator_variance.json]

``runs/hard_mid`` is a hard model mid-training, e.g. ``captioning train --config
configs/shapes_hard.yaml --set train.epochs=2 --out runs/hard_mid``.

The checkpoint must be a hard-attention model with ``model.context_to_lstm: false``: then
h_t does not depend on the cells, the marginal log p(y | a) = sum_t log sum_l alpha_tl
p(y_t | a_l, h_t) is exact, and so is its gradient (the ``exact`` estimator). So is the
gradient of the paper's objective E_q[log p(y | s, a)] = sum_t sum_l alpha_tl
log p(y_t | a_l, h_t), which REINFORCE, leave-one-out and Gumbel estimate (computed here one
cell at a time).

On one fixed batch of training captions (model in eval mode, so that dropout adds no noise),
every estimator is run ``--repeats`` times with fresh samples. The table gives, over all
trainable weights: seconds per estimate; the variance (trace of the covariance of one
estimate); the squared bias and the mean squared error against the exact gradient of log
p(y | a); and MSE x seconds, the error that one second of estimates leaves (smaller is
better). All estimators use lambda_r = 1, no entropy bonus, no penalty and no mixing with the
expected context (every minibatch samples; ``exact`` takes the marginal on every minibatch,
whatever the checkpoint's ``train.exact_soft_p``), so that each estimates its objective's
gradient; "reinforce (paper)" adds the authors' lambda_r = 0.1 and entropy bonus 0.002, which
bias it on purpose.

Each estimator is measured with the baseline it trains with: leave-one-out and VIMCO with
their own (the other samples of the caption), Gumbel and exact with none, and REINFORCE with
its moving-average baseline b (decay ``train.baseline_decay``) as it stands at this point of
training: the checkpoint's own when REINFORCE trained it, else the moving average of the mean
reward over ``--baseline-batches`` training batches after the measured one (the batch itself
is left out, so that b does not know its rewards). "reinforce, no baseline" (b = 0) shows what
the baseline removes.

Writes ``OUT/estimators.json`` and ``OUT/estimators.md``; the rows, with their settings, the
commit, the command, the device and threads (:mod:`lab.runner`'s recorder), merge by
estimator into ``--results FILE`` where given, else into ``OUT/rows.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from captioning.checkpoint import load_checkpoint
from captioning.config import Config, replace_section
from captioning.data import CaptionDataset, collate, load_splits
from captioning.data.vocab import Vocabulary
from captioning.errors import CaptioningError
from captioning.inference.caption import load_model
from captioning.models import Captioner
from captioning.models.attention import HardContext
from captioning.objectives import Batch
from captioning.objectives.hard_attention import HardAttentionObjective
from lab.options import fail
from lab.provenance import cpu_model, portable
from lab.runner import Recorder

# the arguments that say where files are (the first four, written portably) or how the rows
# are kept, not what is measured: left out of a row's fingerprint in its results file
PATHS = ("checkpoint", "data_root", "out", "results", "replace", "machine_busy")

UNBIASED = {
    "reinforce_weight": 1.0,
    "entropy_weight": 0.0,
    "doubly_stochastic_weight": 0.0,
    "semi_sampling_p": 1.0,
    "exact_soft_p": 0.0,
}
# label: (estimator, its settings beside UNBIASED, whether it uses the moving-average baseline)
ROWS = {
    "reinforce, no baseline": ("reinforce", {}, False),
    "reinforce (its moving-average baseline)": ("reinforce", {}, True),
    "reinforce (paper: lambda_r 0.1, entropy 0.002, its moving-average baseline)": (
        "reinforce",
        {"reinforce_weight": 0.1, "entropy_weight": 0.002},
        True,
    ),
    "reinforce_loo": ("reinforce_loo", {}, False),
    "vimco": ("vimco", {}, False),
    "gumbel (temperature 1)": ("gumbel", {}, False),
    "gumbel (temperature 0.5)": (
        "gumbel",
        {"gumbel_temperature": 0.5, "gumbel_min_temperature": 0.5},
        False,
    ),
    "exact": ("exact", {}, False),
}


def _flat_grad(model: Captioner) -> torch.Tensor:
    return torch.cat(
        [
            p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
            for p in model.parameters()
            if p.requires_grad
        ]
    )


def _objective(cfg: Config, estimator: str, settings: dict, samples: int, cells: int):
    train = {**UNBIASED, "hard_estimator": estimator, "hard_samples": samples, **settings}
    cfg = replace_section(cfg, "train", **train)
    return HardAttentionObjective(cfg, cells, torch.device("cpu"), "fp32")


def paper_gradient(model: Captioner, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The exact gradient of -E_q[log p(y | s, a)] (mean over captions), one cell at a time:
    without the context in the LSTM it is -sum_t sum_l alpha_tl log p(y_t | a_l, h_t)."""
    model.zero_grad(set_to_none=True)
    features = model.encode(images)
    grid = features.detach().requires_grad_()
    targets = tokens[:, 1:]
    mask = (targets != Vocabulary.pad_id).float()
    for cell in range(grid.shape[1]):
        cells = torch.full_like(targets, cell)
        out = model.decoder(grid, tokens[:, :-1], HardContext(mode="sample", cells=cells))
        log_p = torch.log_softmax(out.logits.float(), dim=2).gather(2, targets[:, :, None])
        expected = (out.alphas[:, :, cell] * log_p.squeeze(2) * mask).sum() / len(tokens)
        (-expected).backward()
    features.backward(grid.grad)
    return _flat_grad(model)


def training_baseline(
    model: Captioner, cfg: Config, objective_state: dict | None, batches: list[dict]
) -> tuple[float, str]:
    """REINFORCE's moving-average baseline at this checkpoint, and where it comes from: the
    checkpoint's own when REINFORCE trained it, else the moving average of the mean reward of
    ``batches`` (training batches other than the measured one), sampled as training samples
    them."""
    state = objective_state or {}
    saved = state.get("baseline") or {}
    if state.get("estimator") == "reinforce" and saved.get("initialized"):
        return float(saved["value"]), "the checkpoint's"
    if not batches:
        raise ValueError("no training batches to estimate the moving-average baseline from")
    cells = model.grid_shape[0] * model.grid_shape[1]
    objective = _objective(cfg, "reinforce", {}, 1, cells)
    with torch.no_grad():
        for step, batch in enumerate(batches):
            objective.loss(model, Batch(batch["tokens"], batch["images"], step=1_000_000 + step))
            objective.commit()
    return objective.baseline.value, f"the moving average over {len(batches)} training batches"


def measure(
    model, cfg, batch, repeats: int, samples: int, baseline: float
) -> tuple[dict, list[dict]]:
    """Every row of ``ROWS`` on ``batch``, REINFORCE's baseline rows with ``baseline``."""
    images, tokens = batch["images"], batch["tokens"]
    cells = model.grid_shape[0] * model.grid_shape[1]
    exact_objective = _objective(cfg, "exact", {}, samples, cells)
    model.zero_grad(set_to_none=True)
    exact_objective.loss(model, Batch(tokens, images)).total.backward()
    exact = _flat_grad(model)
    start = time.perf_counter()
    paper = paper_gradient(model, images, tokens)
    paper_seconds = time.perf_counter() - start
    reference = {
        "marginal_gradient_norm": float(exact.norm()),
        "paper_gradient_norm": float(paper.norm()),
        "cosine_marginal_paper": float(torch.nn.functional.cosine_similarity(exact, paper, 0)),
        "paper_gradient_seconds": paper_seconds,
        "baseline": baseline,
    }
    rows = []
    for name, (estimator, settings, moving_average) in ROWS.items():
        objective = _objective(cfg, estimator, settings, samples, cells)
        if moving_average:
            objective.baseline.value, objective.baseline.initialized = baseline, True
        estimates, seconds = [], []
        for repeat in range(1 if estimator == "exact" else repeats):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            objective.loss(model, Batch(tokens, images, step=repeat)).total.backward()
            seconds.append(time.perf_counter() - start)
            estimates.append(_flat_grad(model))
        stack = torch.stack(estimates)  # (repeats, P)
        mean = stack.mean(dim=0)
        variance = float(stack.var(dim=0).sum()) if len(stack) > 1 else 0.0
        errors = ((stack - exact) ** 2).sum(dim=1)  # squared error of each estimate
        mse = float(errors.mean())
        second = sorted(seconds)[len(seconds) // 2]
        rows.append(
            {
                "estimator": name,
                "seconds": second,
                "variance": variance,
                # |mean - exact|^2 overestimates the squared bias by variance / n
                "bias2_marginal": max(
                    0.0, float(((mean - exact) ** 2).sum()) - variance / len(stack)
                ),
                "mse_marginal": mse,
                "mse_paper": float(((stack - paper) ** 2).sum(dim=1).mean()),
                "mse_x_seconds": mse * second,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return reference, rows


def markdown(reference: dict, rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| estimator | s / estimate | variance | bias² vs ∇log p(y) | MSE vs ∇log p(y) | "
        "MSE vs ∇E_q[r] | MSE × s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['estimator']} | {r['seconds']:.3f} | {r['variance']:.3g} | "
            f"{r['bias2_marginal']:.3g} | {r['mse_marginal']:.3g} | {r['mse_paper']:.3g} | "
            f"{r['mse_x_seconds']:.3g} |"
        )
    lines += [
        "",
        f"|∇log p(y | a)|² = {reference['marginal_gradient_norm'] ** 2:.3g}, "
        f"|∇E_q[r]|² = {reference['paper_gradient_norm'] ** 2:.3g} (r = log p(y | s, a)), "
        f"cosine between them {reference['cosine_marginal_paper']:.3f}. REINFORCE's "
        f"moving-average baseline b = {reference['baseline']:.3g} "
        f"({reference['baseline_source']}).",
    ]
    return "\n".join(lines)


def batches_of(records, vocab, model: Captioner, cfg: Config, size: int) -> list[dict]:
    """The records in batches of ``size`` captions, each image's first caption."""
    dataset = CaptionDataset(
        records, vocab, model.encoder.transform, max_length=cfg.data.max_caption_length
    )
    return [
        collate([dataset[(i, 0)] for i in range(start, min(start + size, len(dataset)))])
        for start in range(0, len(dataset), size)
    ]


def measured_settings(row: dict[str, Any]) -> dict[str, Any]:
    """A row's fingerprint for its results file: the measuring arguments, the paths aside."""
    return {k: v for k, v in row["settings"].items() if k not in PATHS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.estimator_variance", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--batch", type=int, default=32, help="captions in the fixed batch")
    parser.add_argument("--repeats", type=int, default=20, help="estimates per estimator")
    parser.add_argument("--samples", type=int, default=4, help="K of reinforce_loo and vimco")
    parser.add_argument(
        "--baseline-batches",
        type=int,
        default=20,
        help="training batches for REINFORCE's moving-average baseline, when "
        "the checkpoint has none of its own",
    )
    parser.add_argument("--data-root", default=None, help="the data, if not the checkpoint's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/estimators", type=Path)
    parser.add_argument(
        "--results", type=Path, help="also merge the rows into this file (results/X.json)"
    )
    parser.add_argument(
        "--replace", action="store_true", help="let a row replace one of other settings"
    )
    parser.add_argument(
        "--machine-busy", action="store_true", help="other work runs beside this one"
    )
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    try:
        model, cfg, vocab = load_model(args.checkpoint)
        if args.data_root:
            cfg = replace_section(cfg, "data", root=args.data_root)
        records = load_splits(cfg.data)["train"]
    except CaptioningError as exc:
        return fail(exc)
    if not model.hard_attention or cfg.model.context_to_lstm:
        return fail(
            CaptioningError(
                "the checkpoint must be a hard-attention model with "
                "model.context_to_lstm=false (the only wiring with an exact gradient)"
            )
        )
    batch = batches_of(records[: args.batch], vocab, model, cfg, args.batch)[0]
    after = records[args.batch : args.batch * (1 + args.baseline_batches)]
    baseline, source = training_baseline(
        model,
        cfg,
        load_checkpoint(args.checkpoint).get("objective"),
        batches_of(after, vocab, model, cfg, args.batch),
    )
    reference, rows = measure(model, cfg, batch, args.repeats, args.samples, baseline)
    reference["baseline_source"] = source
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    places = {"OUT": out, "DATA": args.data_root}
    settings = {
        k: v if k not in PATHS[:4] or v is None else portable(str(v), places)
        for k, v in vars(args).items()
    }
    (out / "estimators.json").write_text(
        json.dumps({"settings": settings, "reference": reference, "rows": rows}, indent=2)
    )
    recorder = Recorder(
        "tools.estimator_variance",
        argv,
        out,
        lambda r: r["estimator"],
        results=args.results,
        replace=args.replace,
        timed_alone=not args.machine_busy,
        places=places,
        settings=measured_settings,
    )
    where = {"precision": "fp32", "threads": torch.get_num_threads(), "device": cpu_model()}
    try:
        recorder.write(
            [{**row, "settings": settings, "reference": reference, **where} for row in rows]
        )
    except CaptioningError as exc:
        return fail(exc)
    header = (
        f"{settings['checkpoint']}: {len(batch['tokens'])} captions, {args.repeats} "
        f"estimates each, K = {args.samples}, seed {args.seed}"
    )
    (out / "estimators.md").write_text(markdown(reference, rows, header) + "\n")
    print(markdown(reference, rows, header))
    print(f"wrote {recorder.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
