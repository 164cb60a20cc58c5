"""Ctrl-C and SIGTERM at many points of a run, from outside, as data.

    python -m tests.signal_points --verb train --points 100 --work /tmp/points --out rows.json

One process imports the package once and forks a child per run (its own process group, so
that a signal reaches it and whatever it starts, as Ctrl-C in a terminal does). Three
children first run the verb to its end; the shortest's length spreads the points over the
whole run (steps, validation, every file write, figures), one point a slice at a random
place in it. Each later child is signalled at its point, SIGINT and SIGTERM in turn, and its
row says what it did: the exit code, stderr's last line, any traceback, what it left in its
folder; for a training, whether ``last.pt`` loads and, resumed, reaches the weights of the
run nobody stopped; for an extraction, whether the cache holds a whole split or none.
``lost`` marks a run that exited 0 though the signal came before its last write.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

from captioning.signals import DEFERRED_SIGNALS

EXPECTED = {"SIGINT": (130, "interrupted"), "SIGTERM": (143, "terminated")}
HUNG = 300.0  # seconds after which a run has hung: a whole run takes seconds
HUNG_CODE = -1000
STACKS = signal.SIGUSR1  # asks a hung child for its threads' stacks (faulthandler)
CONFIG = "configs/test_tiny.yaml"


def verb_argv(verb: str, shapes: Path, folder: Path) -> list[str]:
    """The command line of one run of ``verb`` writing into ``folder``."""
    common = ["--config", CONFIG, "--set", f"data.root={shapes}", "--set", "train.threads=1"]
    if verb == "train":
        settings = [
            "model.hidden_dim=512",  # a checkpoint of about 25 MB: its writes take time
            "model.embed_dim=256",
            "train.epochs=3",
            "train.figure_every_epoch=true",
        ]
        argv = ["train", *common, "--out", str(folder), "--quiet"]
    else:
        settings = ["model.fine_tune=none", f"data.feature_cache={folder}"]
        argv = ["extract-features", *common, "--split", "train", "--batch-size", "4", "--quiet"]
    for setting in settings:
        argv += ["--set", setting]
    return argv


def fork_run(
    argv: list[str],
    stderr: Path,
    signum: int | None = None,
    after: float = 0.0,
    background: bool = False,
    limit: float = HUNG,
):
    """Run the CLI on ``argv`` in a forked child (its own process group) and signal the
    group ``after`` seconds in (``background``: started as a non-interactive shell starts
    ``command &``, with Ctrl-C ignored); (exit code, seconds it ran, the wall-clock time the signal
    went or None if the child had ended). The child starts with both signals blocked, and
    the command unblocks them under its handlers (captioning.signals.stops_on_signals).
    A child still running ``limit`` seconds in has hung: its state and every thread's stack
    go to its stderr file, its group is killed, and its exit code is :data:`HUNG_CODE`."""
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: the CLI, as `captioning ...` runs it
        code = 1
        try:
            # held until the command's handlers are in place: what lands before its first
            # line is the interpreter's start, not the command's
            signal.pthread_sigmask(signal.SIG_BLOCK, DEFERRED_SIGNALS)
            os.setpgid(0, 0)
            if background:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            fd = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 2)
            faulthandler.register(STACKS, file=sys.stderr, all_threads=True)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            from captioning.cli import main

            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # a signal after main returned, or a crash: say so
            import traceback

            traceback.print_exc()
            code = 99
        finally:
            sys.stderr.flush()
            os._exit(code)
    sent, status = None, None
    while signum is not None and status is None and sent is None:
        done, status_now = os.waitpid(pid, os.WNOHANG)
        if done:
            status = status_now
        elif time.monotonic() - started >= after:
            try:
                os.killpg(pid, signum)
                sent = time.time()
            except ProcessLookupError:  # its group is not made yet, or it ended: look again
                time.sleep(0.001)
        else:
            time.sleep(max(0.0, min(0.002, after - (time.monotonic() - started))))
    while status is None:
        done, status_now = os.waitpid(pid, os.WNOHANG)
        if done:
            status = status_now
        elif time.monotonic() - started > limit:
            return _hung(pid, stderr), time.monotonic() - started, sent
        else:
            time.sleep(0.005)
    return os.waitstatus_to_exitcode(status), time.monotonic() - started, sent


def _hung(pid: int, stderr: Path) -> int:
    """Say where the hung child ``pid`` is (its kernel state and wait channel, then every
    Python thread's stack) in its ``stderr`` file, and kill its group."""
    proc = Path(f"/proc/{pid}")
    with stderr.open("a") as err:
        err.write("\nhung: ")
        for name in ("wchan", "status"):
            with contextlib.suppress(OSError):
                text = (proc / name).read_text()
                err.write(" ".join(text.splitlines()[:3]) + "; ")
        err.write("\n")
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, STACKS)
        time.sleep(2.0)  # the stacks are written by the child's own handler
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return HUNG_CODE


WRITTEN = {"train": ("*.pt", "figures/*.png", "config.yaml"), "extract": ("*/*.npy", "*/*.json")}
LEFT_BEHIND = ("**/.*.tmp", "**/*.partial.npy", "**/*.compact.npy")


def last_write(verb: str, folder: Path) -> float:
    """When the run last wrote one of its files (wall clock); 0 if it wrote none."""
    times = [p.stat().st_mtime for pattern in WRITTEN[verb] for p in folder.glob(pattern)]
    return max(times, default=0.0)


def weights(path: Path) -> dict[str, Any]:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def same_weights(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def features(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.glob("*/train.*"))}


def judge(verb: str, name: str, folder: Path, code: int, sent: float | None, err: str) -> dict:
    """What one signalled run did, and whether that is what a user was promised."""
    lines = err.strip().splitlines()
    row: dict[str, Any] = {"code": code, "said": lines[-1] if lines else ""}
    row["hung"] = code == HUNG_CODE
    row["traceback"] = "Traceback" in err
    row["left"] = sorted(str(p.relative_to(folder)) for g in LEFT_BEHIND for p in folder.glob(g))
    wrote = last_write(verb, folder)
    row["sent_after_last_write"] = sent is None or sent >= wrote > 0
    expected_code, expected_said = EXPECTED[name]
    stopped = code == expected_code and row["said"] == expected_said
    finished = code == 0 and row["sent_after_last_write"]
    row["lost"] = code == 0 and not row["sent_after_last_write"]
    row["ok"] = (stopped or finished) and not row["traceback"] and not row["left"]
    return row


def run_points(
    verb: str, points: int, work: Path, shapes: Path, seed: int, background: bool = False
) -> list[dict]:
    """The reference run, then ``points`` signalled runs (and, for a training, each one
    resumed); one row per signalled run."""
    work.mkdir(parents=True, exist_ok=True)
    reference = work / "reference"
    lengths = []
    for again in range(3):  # the shortest of three: the first runs cold, the points land warm
        folder = reference if again == 0 else work / f"reference{again}"
        code, length, _ = fork_run(verb_argv(verb, shapes, folder), work / "reference.err")
        if code != 0:
            raise SystemExit(
                f"the run nobody stopped failed: {(work / 'reference.err').read_text()}"
            )
        lengths.append(length)
    length = min(lengths)
    final = weights(reference / "last.pt") if verb == "train" else features(reference)
    rng = random.Random(seed)
    rows = []
    for index in range(points):
        name = ("SIGINT", "SIGTERM")[index % 2]
        after = length * (index + rng.random()) / points
        folder = work / f"{verb}{index:03d}"
        err_file = work / f"{verb}{index:03d}.err"
        argv = verb_argv(verb, shapes, folder)
        code, _, sent = fork_run(argv, err_file, getattr(signal, name), after, background)
        row = {
            "verb": verb,
            "background": background,
            "signal": name,
            "at": round(after, 3),
            "length": round(length, 3),
        }
        row.update(judge(verb, name, folder, code, sent, err_file.read_text()))
        row.update(finish(verb, shapes, folder, final, work / f"{verb}{index:03d}.resume.err"))
        row["ok"] = row["ok"] and row["finishes"]
        if not row["ok"]:  # what it printed, for whoever reads the failure
            row["stderr"] = err_file.read_text()[-1500:]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def finish(verb: str, shapes: Path, folder: Path, final, err_file: Path) -> dict[str, Any]:
    """A stopped run continued as a user would: a training resumed from its ``last.pt``
    (when it has one) must reach the weights of the run nobody stopped; an extraction run
    again must write the same split."""
    argv = verb_argv(verb, shapes, folder)
    last = folder / "last.pt"
    if verb == "extract" and list(folder.glob("*/train.npy")):
        now = features(folder)  # written whole before the signal came
        return {"finishes": now == final, **({} if now == final else {"why": "another split"})}
    if verb == "train" and last.exists():
        try:
            weights(last)
        except Exception as exc:  # a half-written checkpoint
            return {"finishes": False, "why": f"last.pt does not load: {exc}"}
        argv += ["--resume", str(last)]
    code, _, _ = fork_run(argv, err_file)
    if code != 0:
        tail = 3000 if code == HUNG_CODE else 300  # a hung run's stacks, whole
        return {"finishes": False, "why": err_file.read_text().strip()[-tail:]}
    now = weights(last) if verb == "train" else features(folder)
    same = same_weights(now, final) if verb == "train" else now == final
    return {"finishes": same, **({} if same else {"why": "ends elsewhere than the run"})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verb", choices=("train", "extract"), required=True)
    parser.add_argument("--points", type=int, default=100)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--shapes", type=Path, help="a shapes data set (made if not given)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="the rows as JSON")
    parser.add_argument(
        "--background",
        action="store_true",
        help="start each run as `command &` in a script does (Ctrl-C ignored)",
    )
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)  # no thread pool in the parent: every child is forked
    import captioning.cli
    import captioning.data.feature_cache
    import captioning.training.train  # noqa: F401  (imported once: a child starts where a run starts)

    if args.work.exists() and any(args.work.iterdir()):
        parser.error(f"--work {args.work} holds files; give a new or empty folder")
    shapes = args.shapes
    if shapes is None:
        from captioning.data.shapes import generate_shapes

        shapes = args.work / "shapes"
        # a training of 3 epochs of 3 steps; an extraction of 100 batches
        count = 24 if args.verb == "train" else 400
        generate_shapes(shapes, num_train=count, num_val=6, num_test=6, seed=0, image_size=48)
    rows = run_points(args.verb, args.points, args.work, shapes, args.seed, args.background)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    bad = [row for row in rows if not row["ok"]]
    print(
        f"{len(rows) - len(bad)} of {len(rows)} runs kept their promise; "
        f"{sum(row['lost'] for row in rows)} lost the signal",
        file=sys.stderr,
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
