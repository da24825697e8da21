"""The capacity model's own error, and its calibration kept across restarts.

`PredictionTracker`: for each request admission let through, the finish it predicted
(queue wait + own prefill + its decode at the predicted step time, for the tokens the
request actually produced) against the finish it had. The ratio actual / predicted is the
model's error; its quantile at the admission confidence (0.9: nine admitted requests in ten
finish within the prediction x margin) becomes the deadline margin once enough requests
have finished, replacing the fixed configured margin (1.2 shed work the machine could do:
the seeds' burst served 14 of ~60 it could have, issue 34). Requests that timed out count
with the time they had (a lower bound of their ratio), so a model that is too optimistic
sees its own misses.

`save` / `load`: the step times per concurrency, the prefill rate and the recent ratios, as
JSON next to the compilation cache, under a key naming the model, its revision and the
engine's shape (`calibration_key`): a restart starts calibrated (online refinements
included) instead of from a short start-up probe, and a different model or engine shape
never reads another's file. Written atomically (temp file + rename); an unreadable or
foreign file is ignored (logged), never fatal.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import tempfile
import threading

import numpy as np

from serving.frontend.capacity_model import CapacityModel

log = logging.getLogger("pagedjax.serving")

FORMAT_VERSION = 1


class PredictionTracker:
    """Recent actual / predicted finish ratios (thread-safe: the engine thread observes,
    handler threads read the margin)."""

    def __init__(self, window: int = 256, min_samples: int = 16):
        self.min_samples = min_samples
        self._ratios: collections.deque[float] = collections.deque(maxlen=window)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ratios)

    def observe(self, predicted_s: float, actual_s: float) -> float | None:
        """Record one finished request; returns its ratio (None when unmeasurable)."""
        if predicted_s <= 0 or actual_s <= 0:
            return None
        ratio = actual_s / predicted_s
        with self._lock:
            self._ratios.append(ratio)
        return ratio

    def quantile(self, q: float) -> float | None:
        """The q-quantile of the recent ratios; None before `min_samples` were seen."""
        with self._lock:
            if len(self._ratios) < self.min_samples:
                return None
            return float(np.quantile(np.asarray(self._ratios), q))

    def ratios(self) -> list[float]:
        with self._lock:
            return list(self._ratios)

    def restore(self, ratios: list[float]) -> None:
        with self._lock:
            self._ratios.extend(float(r) for r in ratios if r > 0)


def calibration_key(identity, stats: dict, max_inflight: int) -> str:
    """What the calibration is valid for: model, revision, engine version and the engine's
    shape (slots, context, KV capacity, page size); a short hash for the file name."""
    parts = {
        "name": getattr(identity, "name", ""),
        "revision": getattr(identity, "revision", ""),
        "engine_version": getattr(identity, "engine_version", ""),
        "max_inflight": max_inflight,
        **{
            k: stats.get(k)
            for k in ("max_num_seqs", "max_model_len", "kv_capacity_tokens", "page_size")
        },
    }
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def calibration_path(cache_dir: str, key: str) -> str:
    """`<cache_dir>/../capacity/<key>.json`: beside the compilation cache, not inside it
    (JAX owns that directory's entries)."""
    root = os.path.dirname(os.path.abspath(os.path.expanduser(cache_dir)).rstrip(os.sep))
    return os.path.join(root, "capacity", f"{key}.json")


def save(path: str, key: str, model: CapacityModel, tracker: PredictionTracker) -> None:
    state = {
        "format": FORMAT_VERSION,
        "key": key,
        "max_inflight": model.max_inflight,
        **model.snapshot(),
        "ratios": tracker.ratios(),
    }
    for field in ("step_s_by_concurrency", "steps_seen", "prefill_rate_by_len"):
        state[field] = {str(c): v for c, v in state[field].items()}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".capacity-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(state, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def load(path: str, key: str, max_inflight: int) -> tuple[CapacityModel, list[float]] | None:
    """The saved model and ratios, or None (no file, another key, unreadable: logged)."""
    try:
        with open(path) as f:
            state = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("capacity calibration %s unreadable (%s); probing instead", path, e)
        return None
    try:
        if state.get("format") != FORMAT_VERSION or state.get("key") != key:
            log.info("capacity calibration %s is for another engine; probing instead", path)
            return None
        steps = {int(c): float(s) for c, s in state["step_s_by_concurrency"].items()}
        model = CapacityModel(
            steps,
            float(state["prefill_tokens_per_s"]),
            max_inflight,
            length_fraction=float(state.get("length_fraction", 1.0)),
            prefill_steps_seen=int(state.get("prefill_steps_seen", 0)),
            prefill_rate_by_len={
                int(n): float(r) for n, r in state.get("prefill_rate_by_len", {}).items()
            }
            or None,
            # NOTE: without them (a file of an earlier version) every size weighs 1, and a
            # size seen in 3 stray steps pooled as much as one seen in thousands: the
            # restarted mock server shed a burst's fourth wave (0.75 of capacity)
            steps_seen={int(c): int(n) for c, n in state.get("steps_seen", {}).items()},
        )
        ratios = [float(r) for r in state.get("ratios", [])]
    except (KeyError, TypeError, ValueError, AssertionError) as e:
        log.warning("capacity calibration %s malformed (%r); probing instead", path, e)
        return None
    return model, ratios


class CalibrationStore:
    """One server's calibration file: loaded at start instead of probing, saved every
    `save_interval_s` while serving (on the engine thread's tick) and at shutdown."""

    def __init__(self, path: str, key: str, save_interval_s: float = 30.0):
        self.path, self.key, self.save_interval_s = path, key, save_interval_s
        self._last_save_s: float | None = None

    def load(self, max_inflight: int, tracker: PredictionTracker) -> CapacityModel | None:
        loaded = load(self.path, self.key, max_inflight)
        if loaded is None:
            return None
        model, ratios = loaded
        tracker.restore(ratios)
        log.info("capacity model loaded from %s: %s", self.path, model.snapshot())
        return model

    def maybe_save(self, model: CapacityModel | None, tracker: PredictionTracker, now: float):
        if model is None:
            return
        if self._last_save_s is not None and now - self._last_save_s < self.save_interval_s:
            return
        self._last_save_s = now
        self.save(model, tracker)

    def save(self, model: CapacityModel | None, tracker: PredictionTracker) -> None:
        if model is None:
            return
        try:
            save(self.path, self.key, model, tracker)
        except OSError as e:  # a full or read-only disk costs the next start a probe only
            log.warning("capacity calibration not saved to %s: %s", self.path, e)
