"""The scan's prediction steps (the notes, 6.4): its flags, the user's prediction, and what is written
and printed before the first timed sample.

`cli/scan.py` calls `add_prediction_arguments` from its own `add_arguments`, `user_prediction` in its
up-front checks (a saturation no scan could measure is a usage error, exit 2, nothing touched), and
`predict_before_timing` after the inputs are built and before its per-B loop: the calibration
(`experiments.calibration.calibrate`: the call overhead of each timed implementation at B = 1, T = 1
and the read probe), one prediction per implementation in the metadata on disk, then the cards on
stdout. The computation lives in
`experiments/prediction*.py`; this module only parses, prints and saves.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from attention_kv_caceh.cli.common import PROG, UsageError
from attention_kv_caceh.experiments.calibration import calibrate
from attention_kv_caceh.experiments.prediction import (
    ScanPrediction,
    UserPrediction,
    check_user_prediction,
    make_scan_prediction,
    parse_saturation,
)
from attention_kv_caceh.experiments.prediction_text import prediction_card
from attention_kv_caceh.experiments.scan import ScanConfig, ScanInputs
from attention_kv_caceh.oracle import OracleMismatch

__all__ = ["add_prediction_arguments", "predict_before_timing", "saturation_flag", "user_prediction"]


def add_prediction_arguments(parser: argparse.ArgumentParser) -> None:
    """--predict TEXT and --predict-saturation B|none."""
    parser.add_argument(
        "--predict",
        default="",
        metavar="TEXT",
        help="your prediction in words, recorded with a timestamp before the first timed sample and shown "
        "beside the verdicts (not checked: it is prose) (default: none)",
    )
    parser.add_argument(
        "--predict-saturation",
        type=saturation_flag,
        default=None,
        metavar="B|none",
        help="your predicted saturation point: a scanned B other than the largest, or 'none' for not "
        "reached; checked against the measured one (default: not given)",
    )


def saturation_flag(text: str) -> str:
    """argparse `type=` of --predict-saturation: a batch size >= 1 or 'none' (`prediction.parse_saturation`).

    Returns the text itself, so that None still means "not given". Raises argparse.ArgumentTypeError.
    """
    try:
        parse_saturation(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def user_prediction(args: argparse.Namespace, batch_sizes: Sequence[int]) -> UserPrediction:
    """The user's prediction from --predict and --predict-saturation, checked against the scanned sizes.

    Raises UsageError for a predicted saturation no scan of `batch_sizes` could measure (a B that is not
    scanned, or the largest one: `prediction.check_user_prediction`).
    """
    given = args.predict_saturation is not None
    user = UserPrediction(
        text=args.predict,
        saturation_given=given,
        saturation=parse_saturation(args.predict_saturation) if given else None,
    )
    try:
        check_user_prediction(user, batch_sizes)
    except ValueError as exc:
        raise UsageError(f"--predict-saturation: {exc}") from None
    return user


def predict_before_timing(
    config: ScanConfig,
    inputs: ScanInputs,
    user: UserPrediction,
    impls: Sequence[str],
    meta: dict[str, Any],
    flush: Callable[[str], None],
) -> dict[str, ScanPrediction] | None:
    """Calibrate each implementation, then write its prediction to the metadata on disk and print it,
    before any B is timed. Returns impl -> prediction, in `impls` order.

    Every implementation's calibration times its own step at B = 1, T = 1; all share the first one's
    read probe. An implementation whose calibration oracle fails is left out (one line on stderr,
    recorded under `oracle_failures` in the metadata) and must not be timed. Returns None after saving
    `status: oracle-failed` when every one failed (nothing timed). The metadata gets `predictions`
    (impl -> record) and, as before, `prediction`: the first implementation's.
    """
    predictions: dict[str, ScanPrediction] = {}
    probe: tuple[float, ...] | None = None
    for impl in impls:
        try:
            calibration = calibrate(config, inputs, impl, probe)
        except OracleMismatch as exc:
            meta.setdefault("oracle_failures", {})[impl] = f"calibration (B=1, T=1): {exc}"
            print(
                f"{PROG}: oracle check failed in the calibration of {impl} (B=1, T=1), nothing timed "
                f"for it: {exc}",
                file=sys.stderr,
            )
            continue
        probe = calibration.probe_samples_ms
        predictions[impl] = make_scan_prediction(config, calibration, user)
    if not predictions:
        flush("oracle-failed")
        return None
    meta["prediction"] = next(iter(predictions.values())).to_json()
    meta["predictions"] = {impl: p.to_json() for impl, p in predictions.items()}
    flush("running")  # on disk before the first timed sample
    for impl, prediction in predictions.items():
        print()
        if len(impls) > 1:
            print(f"[{impl}]")
        print(prediction_card(prediction), flush=True)  # flushed: a pipe must show it before the timing
    return predictions
