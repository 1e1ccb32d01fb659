"""The generation server under faults (issue 30): a signal to any rank of a TP = 2 server stops
every rank cleanly within seconds."""

import signal
import time

import pytest

from tests.helpers.serving import Server, convert, make_checkpoint

pytest.importorskip("httpx", reason="httpx is not installed (pip install -e '.[serve]')")
pytest.importorskip("fastapi", reason="fastapi is not installed (pip install -e '.[serve]')")
pytest.importorskip("uvicorn", reason="uvicorn is not installed (pip install -e '.[serve]')")


@pytest.fixture(scope="module")
def tp2_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    ckpt = make_checkpoint(root / "tp1")
    convert(
        ["--load", ckpt, "--save", str(root / "tp2"), "--target-tensor-model-parallel-size", "2"]
    )
    return str(root / "tp2")


def _signal_and_wait(srv: Server, ranks: list[int], timeout: float = 20) -> tuple[list, float]:
    """SIGTERM to these ranks at once (torchrun signals all of them); exit codes and seconds."""
    sent = time.monotonic()
    for r in ranks:
        srv.procs[r].send_signal(signal.SIGTERM)
    codes = []
    for p in srv.procs:
        try:
            codes.append(p.wait(timeout=max(sent + timeout - time.monotonic(), 0.1)))
        except Exception:  # noqa: BLE001 - still running: the failure the test looks for
            p.kill()
            codes.append(f"still running after {timeout} s")
    return codes, time.monotonic() - sent


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [[0, 1], [1]], ids=["all-ranks", "follower-only"])
def test_sigterm_to_any_rank_stops_every_rank_cleanly(tp2_checkpoint, ranks):
    """Before: a follower died of the signal inside its broadcast, rank 0's stop broadcast
    failed ("Connection closed by peer") and rank 0 hung until torchrun's SIGKILL (30 s)."""
    srv = Server(tp2_checkpoint, world=2)
    codes, seconds = _signal_and_wait(srv, ranks)
    errors = [p.stderr.read()[-2000:] for p in srv.procs]
    # a rank still running after _signal_and_wait's 20 s (the old hang) fails here; no finer
    # time bound: a loaded machine takes 10 s to stop a healthy server
    assert codes == [0, 0], (codes, seconds, errors)
