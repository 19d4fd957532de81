"""The scan's prediction steps (the notes, 6.4): its flags, the user's prediction, and what is written
and printed before the first timed sample.

`cli/scan.py` calls `add_prediction_arguments` from its own `add_arguments`, `user_prediction` in its
up-front checks (a saturation no scan could measure is a usage error, exit 2, nothing touched), and
`predict_before_timing` after the inputs are built and before its per-B loop: the calibration
(`experiments.calibration.calibrate`: the call overhead at B = 1, T = 1 and the read probe), the
prediction in the metadata on disk, then its card on stdout. The computation lives in
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
    meta: dict[str, Any],
    flush: Callable[[str], None],
) -> ScanPrediction | None:
    """Calibrate, then write the prediction to the metadata on disk and print it, before any B is timed.

    Returns None after saving `status: oracle-failed` and printing one line when the calibration's own
    oracle check fails (nothing timed).
    """
    try:
        calibration = calibrate(config, inputs)
    except OracleMismatch as exc:
        flush("oracle-failed")
        print(
            f"{PROG}: oracle check failed in the calibration (B=1, T=1), nothing timed: {exc}",
            file=sys.stderr,
        )
        return None
    prediction = make_scan_prediction(config, calibration, user)
    meta["prediction"] = prediction.to_json()
    flush("running")  # on disk before the first timed sample
    print()
    print(prediction_card(prediction), flush=True)  # flushed: a pipe must show it before the timing
    return prediction
