"""Straggler detection (`--log-straggler`, Megatron-LM's flags): every --log-interval each rank
sends its time per section of the step (forward, backward, optimizer, data, communication wait)
in one all-gather of a few floats, and the log names the ranks whose compute is slowest against
the median, with their host.

Why our own and not nvidia-resiliency-ext's `straggler.Detector` (Megatron-core's engine): its
`Detector.initialize` loads a CUPTI extension (libcupti.so.12) and its report calls
`torch.cuda.synchronize()`, so it cannot run on CPU / gloo, where every test of this project
runs; it also reports on a wall-clock interval, not at the log line. See docs/operations.md.

Compute is what a rank does alone (forward, backward, optimizer, reading the batch); the
communication wait (gradient reduction, pipeline receives and sends) is where the other ranks
wait for a straggler, so it is reported but not ranked on. Times come from the trainer's own
timers (training/timers.py), which this module wraps: on CUDA with events recorded on the
stream (read at the log line, where the loop waits for the device anyway), never a sync; on
CPU with the wall clock. The data section is the host's time in `next()` of the data iterator,
which runs inside the forward timer: forward is reported without it.
"""

from __future__ import annotations

import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

from megatron.config.declare import fail
from megatron.resilience.straggler_report import SECTIONS, RankTimes, report_lines

# The trainer's timers (training/step.py, schedules.py, pipeline.py) and their section.
TIMER_SECTIONS = {
    "forward-compute": "forward",
    "backward-compute": "backward",
    # DualPipeV's overlapped pairs (training/pipeline.py): a forward and a backward interleaved
    # in one timer; in forward, whose data read (timed apart) it contains
    "forward-backward-overlap": "forward",
    "optimizer": "optimizer",
    "grads-all-reduce": "comm-wait",
    "pipeline-wait": "comm-wait",
    "pipeline-send": "comm-wait",
}


class _HostClock:
    """Seconds of wall time between start() and stop(), summed."""

    def __init__(self):
        self.seconds, self._t0 = 0.0, None

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self._t0 = None

    def take(self) -> float:
        out, self.seconds = self.seconds, 0.0
        return out


class _EventClock:
    """Device time between start() and stop() from CUDA events on the current stream, summed
    when taken (after the log line's wait for the device); events are reused."""

    def __init__(self):
        self.pairs, self.pool, self._start = [], [], None

    def _event(self):
        return self.pool.pop() if self.pool else torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        self._start = self._event()
        self._start.record()

    def stop(self) -> None:
        if self._start is not None:
            end = self._event()
            end.record()
            self.pairs.append((self._start, end))
            self._start = None

    def take(self) -> float:
        if not self.pairs:
            return 0.0
        self.pairs[-1][1].synchronize()
        ms = sum(a.elapsed_time(b) for a, b in self.pairs)
        self.pool += [e for pair in self.pairs for e in pair]
        self.pairs.clear()
        return ms / 1000.0


class _SectionTimer:
    """A trainer timer that also feeds a section clock while the detector is on."""

    def __init__(self, inner, clock, detector: StragglerDetector):
        self.inner, self.clock, self.detector = inner, clock, detector

    def start(self) -> None:
        self.inner.start()
        if self.detector.on:
            self.clock.start()

    def stop(self) -> None:
        self.clock.stop()  # a no-op unless started
        self.inner.stop()


class _TimedIterator:
    """The training data iterator, with the host time of each next() in the data section."""

    def __init__(self, source, clock: _HostClock, detector: StragglerDetector):
        self.source, self.clock, self.detector = source, clock, detector

    def __iter__(self):
        return self

    def __next__(self):
        if not self.detector.on:
            return next(self.source)
        self.clock.start()
        try:
            return next(self.source)
        finally:
            self.clock.stop()


def straggler_detector(lg, rt, out) -> StragglerDetector | None:
    """This rank's detector with --log-straggler (built on every rank: a collective), else None."""
    return StragglerDetector(lg, rt.state, rt.device, out) if lg.log_straggler else None


class StragglerDetector:
    """One per rank; every rank calls report() at every log line (it is a collective)."""

    def __init__(self, lg, state, device: torch.device, out=sys.stdout):
        self.count, self.rank, self.device = lg.straggler_minmax_count, state.rank, device
        self.pp_rank, self.on = state.pp_rank, not lg.disable_straggler_on_startup
        clock = _EventClock if device.type == "cuda" else _HostClock
        self.clocks = {name: clock() for name in SECTIONS if name != "data"}
        self.clocks["data"] = _HostClock()  # reading the batch is host work
        self._wrapped: dict[str, _SectionTimer] = {}
        self.controller = None
        if self.rank == 0:
            self.controller = _Controller(lg.straggler_ctrlr_port, self, out)
        # host names, and why rank 0 cannot listen ("" if it does): every rank refuses together
        hosts = _gather_objects((socket.gethostname(), self._listen_error()))
        self.hosts = [host for host, _ in hosts]
        if hosts[0][1] and not self.on:
            self.close()
            fail(
                "--straggler-ctrlr-port",
                f"rank 0 cannot listen on port {lg.straggler_ctrlr_port} ({hosts[0][1]}), and "
                "with --disable-straggler-on-startup the detector could only be turned on there",
                "pick a free port, or drop --disable-straggler-on-startup",
            )

    def _listen_error(self) -> str:
        if self.controller is None or self.controller.listening:
            return ""
        return str(self.controller.error)

    def wrap(self, name: str, timer):
        """The trainer's timer `name`, feeding its section when it has one."""
        section = TIMER_SECTIONS.get(name)
        if section is None:
            return timer
        wrapped = self._wrapped.get(name)
        if wrapped is None or wrapped.inner is not timer:
            wrapped = self._wrapped[name] = _SectionTimer(timer, self.clocks[section], self)
        return wrapped

    def data_iterator(self, source):
        return _TimedIterator(source, self.clocks["data"], self)

    def report(self, iteration: int, iterations: int) -> tuple[list[str], dict[str, float]]:
        """Gather every rank's section times of the last `iterations` steps; returns the log
        lines and the TensorBoard / W&B scalars (the same on every rank). Also takes a toggle
        asked for on --straggler-ctrlr-port, on every rank at once."""
        was_on = self.on
        seconds = {name: clock.take() for name, clock in self.clocks.items()}
        toggle = self.controller.take_request() if self.controller is not None else False
        mine = [float(toggle), float(self.pp_rank)] + [seconds[s] for s in SECTIONS]
        gathered = _all_gather(mine, self.device)
        lines, scalars = [], {}
        if was_on:
            lines, scalars = report_lines(
                self._rows(gathered, iterations), self.count, iteration, iterations
            )
        if gathered[0][0]:  # rank 0's controller was asked to toggle
            self.on = not self.on
            state = "on" if self.on else "off"
            lines.append(
                f" straggler detector turned {state} at iteration {iteration} "
                "(--straggler-ctrlr-port)"
            )
        return lines, scalars

    def _rows(self, gathered: list[list[float]], iterations: int) -> list[RankTimes]:
        per_iter = 1000.0 / max(iterations, 1)  # seconds in the window -> ms per iteration
        return [
            RankTimes(
                r,
                self.hosts[r],
                int(v[1]),
                dict(zip(SECTIONS, [per_iter * x for x in v[2:]], strict=True)),
            )
            for r, v in enumerate(gathered)
        ]

    def close(self) -> None:
        if self.controller is not None:
            self.controller.close()


def _all_gather(values: list[float], device) -> list[list[float]]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [t.tolist()]
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.stack(out).tolist()


def _gather_objects(obj) -> list:
    """Every rank's `obj`, once at start (the only non-tensor collective)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class _Controller:
    """Megatron-LM's switch: rank 0 listens on --straggler-ctrlr-port; each connection (an
    HTTP request, e.g. `curl HOST:PORT`) asks to toggle the detector, which every rank does
    at the next log line."""

    def __init__(self, port: int, detector: StragglerDetector, out):
        self.port, self.detector, self.requested, self.error = port, detector, False, None
        self.lock = threading.Lock()  # a request arriving while the log line takes one
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind(("0.0.0.0", port))
            self.sock.listen(16)
        except OSError as e:
            self.sock.close()
            self.sock, self.error = None, e
            print(
                f"warning: --straggler-ctrlr-port {port}: cannot listen ({e}); the straggler "
                "detector stays on and cannot be toggled at run time (pick a free port)",
                file=out,
                flush=True,
            )
            return
        threading.Thread(target=self._serve, name="straggler-ctrlr", daemon=True).start()

    @property
    def listening(self) -> bool:
        return self.sock is not None

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            with conn:
                conn.settimeout(1.0)
                try:
                    conn.recv(1024)
                except OSError:
                    pass
                with self.lock:
                    self.requested = True
                state = "off" if self.detector.on else "on"
                body = f"straggler detector turns {state} at the next log line\n"
                head = (
                    f"HTTP/1.0 200 OK\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n"
                )
                try:
                    conn.sendall((head + body).encode())
                except OSError:
                    pass

    def take_request(self) -> bool:
        with self.lock:
            requested, self.requested = self.requested, False
        return requested

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
            except OSError:
                pass
            self.sock.close()
            self.sock = None
