"""The turnstile between an engine's decode steps and weight loads that land mid-generation."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class WeightGate:
    """Lets decode steps and weight loads take turns, so no step sees a half-loaded model.

    The decoding thread runs each forward pass inside `step()`. A weight update, on another
    thread, calls `close()`, which waits for the step in progress to end and holds back the
    next ones; it copies its tensors in (calling `changed()` before it does), and `open()` lets
    the decoder go on. `epoch` counts the closed periods in which the weights changed: a
    decoder that finds it moved since it built its KV cache knows the cache came from other
    weights.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._closed = False
        self._stepping = 0
        self.epoch = 0
        """How many times the weights changed behind the closed gate."""

    @property
    def closed(self) -> bool:
        """Whether a weight update holds the gate."""
        return self._closed

    @contextlib.contextmanager
    def step(self) -> Iterator[int]:
        """Run one decode step on whole weights: waits while the gate is closed, and holds
        `close()` back until the step ends. Yields `epoch`, which cannot move meanwhile."""
        with self._cond:
            self._cond.wait_for(lambda: not self._closed)
            self._stepping += 1
            epoch = self.epoch
        try:
            yield epoch
        finally:
            with self._cond:
                self._stepping -= 1
                self._cond.notify_all()

    def close(self) -> None:
        """Hold back decode steps; returns once the step in progress (if any) has ended.

        Raises:
            RuntimeError: The gate is closed already (one weight update at a time).
        """
        with self._cond:
            if self._closed:
                raise RuntimeError("the weight gate is closed already")
            self._closed = True
            self._cond.wait_for(lambda: self._stepping == 0)

    def changed(self) -> None:
        """Record that the weights are being changed (call it while the gate is closed)."""
        with self._cond:
            assert self._closed, "weights may change only while the gate is closed"
            self.epoch += 1

    def open(self) -> None:
        """Let decode steps run again (a no-op on an open gate)."""
        with self._cond:
            self._closed = False
            self._cond.notify_all()
