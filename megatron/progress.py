"""Progress of long tools (preprocessing, checkpoint conversion, evaluation): a tqdm bar when
the stream is a terminal and tqdm is installed; otherwise a plain line now and then, which
reads well in a log file or a CI job (no carriage returns).
"""

from __future__ import annotations

import sys
import time


def is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _tqdm():
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


class Progress:
    """`update(done, total)` with absolute counts; `close()` at the end.

    `unit="B"` counts bytes (shown as MB); plain lines come every `every_s` seconds, so a job
    shorter than that prints none.
    """

    def __init__(
        self, label: str, total: int = 0, unit: str = "it", stream=None, every_s: float = 10.0
    ):
        self.label, self.total, self.unit, self.every_s = label, total, unit, every_s
        self.stream = stream if stream is not None else sys.stderr
        self.done, self._last_line = 0, time.monotonic()
        tqdm = _tqdm() if is_terminal(self.stream) else None
        self.bar = None
        if tqdm is not None:
            self.bar = tqdm(
                total=total or None,
                desc=label,
                unit=unit,
                unit_scale=unit == "B",
                file=self.stream,
                dynamic_ncols=True,
            )

    def __call__(self, done: int, total: int | None = None) -> None:
        self.update(done, total)

    def update(self, done: int, total: int | None = None, note: str = "") -> None:
        if total is not None:
            self.total = total
        if self.bar is not None:
            if total is not None and self.bar.total != total:
                self.bar.total = total
            self.bar.update(done - self.done)
            if note:
                self.bar.set_postfix_str(note, refresh=False)
        elif time.monotonic() - self._last_line >= self.every_s:
            self._line(done, note)
        self.done = done

    def _line(self, done: int, note: str) -> None:
        self._last_line = time.monotonic()
        scale, unit = (1e6, "MB") if self.unit == "B" else (1, self.unit)
        of = f" of {self.total / scale:g}" if self.total else ""
        pct = f" ({100.0 * done / self.total:.0f}%)" if self.total else ""
        note = f" | {note}" if note else ""
        print(f"{self.label}: {done / scale:g}{of} {unit}{pct}{note}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
