"""--async-save: checkpoint files written on a background thread while training goes on.

At a save step the state is staged: every tensor copied off the training tensors into host
memory that is kept and reused from one save to the next (on a GPU into pinned buffers, by
torch.distributed.checkpoint's BlockingAsyncStager; on the CPU into the previous save's
copies). That copy is the whole stall; the buffers cost one more host copy of the state. A
background thread then writes exactly the files a synchronous save writes
(megatron.checkpoint.storage: temp file, fsync, rename). The commit (completion marker with
checksums, then the pointer) needs every rank's files and collectives, so it runs on the
training thread: at the start of each later step the ranks agree (one scalar all-reduce, only
while a save is in flight) whether every writer is done, and commit then. A writer that failed
makes that commit raise the usual CheckpointError naming the rank and file, on every rank, at
that step, noting that the staged iteration never committed. The trainer logs a save as staged
when it is staged and as saved only once its commit is done (`take_committed`). At most one
save is in flight: the next save step, the end of training and a SIGTERM exit first wait for
the writer and commit. A SIGKILL at any moment leaves the pointer on the
previous complete checkpoint (the commit never ran) and at worst temp files the next save of
that iteration removes.

torch.distributed.checkpoint.async_save itself writes DCP's own format (.distcp files and a
.metadata), not the shards users' tools read, so only its staging is used here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from megatron.checkpoint.storage import CheckpointError


class AsyncSaver:
    """At most one checkpoint write in flight on a background thread; its commit runs on the
    training thread (`poll` at each step, `wait` before the next save and at exit)."""

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        # Pinned, reused buffers pay off on a GPU; on the CPU a plain copy is all there is.
        self._stager = BlockingAsyncStager(cache_staged_state_dict=self.device.type == "cuda")
        self._cache: dict[str, object] = {}  # CPU: the staged copies, reused by the next save
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._commit: Callable[[BaseException | None], None] | None = None
        self.iteration: int | None = None
        self._committed: list[int] = []  # iterations committed since `take_committed`

    def stage(self, state, key: str = "state"):
        """A host copy of `state` (nested containers of tensors and plain values) that later
        training steps cannot change. On the CPU the copies go into the buffers of the last
        save under `key` when the shapes still match: a copy into memory already touched costs
        about a third of one into fresh pages."""
        if self.device.type != "cuda":
            self._cache[key] = _copy_into(state, self._cache.get(key))
            return self._cache[key]
        try:
            staged = self._stager.stage(state)
        except Exception:  # noqa: BLE001 - the cached buffers no longer fit this state's shape
            self._stager = BlockingAsyncStager(cache_staged_state_dict=False)
            staged = self._stager.stage(state)
        torch.cuda.synchronize(self.device)  # the copies into pinned memory are async
        return staged

    @property
    def pending(self) -> bool:
        return self._commit is not None

    def start(
        self,
        iteration: int,
        write: Callable[[], None],
        commit: Callable[[BaseException | None], None],
    ) -> None:
        """Run `write()` (this rank's files) in the background; `commit(error or None)` runs
        on this thread once every rank's write is over (`poll` / `wait`)."""
        if self.pending:
            raise RuntimeError("a checkpoint save is already in flight; wait() for it first")
        self._error, self._commit, self.iteration = None, commit, iteration

        def run() -> None:
            try:
                write()
            except BaseException as e:  # noqa: BLE001 - handed to the commit on the main thread
                self._error = e

        # Not a daemon: an interpreter exiting on an error still lets the files finish.
        self._thread = threading.Thread(target=run, name=f"checkpoint-writer-{iteration}")
        self._thread.start()

    def done_here(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def poll(self, all_ranks: Callable[[bool], bool]) -> bool:
        """Commit if every rank's writer is done (`all_ranks(mine)`: the agreement, a
        collective every rank calls at the same step). True if a commit ran."""
        if not self.pending or not all_ranks(self.done_here()):
            return False
        self._finish()
        return True

    def wait(self) -> None:
        """Block until this rank's writer is done, then commit (every rank calls it together)."""
        if not self.pending:
            return
        self._thread.join()
        self._finish()

    def take_committed(self) -> list[int]:
        """The iterations whose save has committed (durable, the pointer on them) since the
        last call: the trainer logs "saved" for them only now, not when they were staged."""
        done, self._committed = self._committed, []
        return done

    def _finish(self) -> None:
        self._thread.join()
        commit, error, iteration = self._commit, self._error, self.iteration
        self._commit, self._error, self._thread, self.iteration = None, None, None, None
        try:
            commit(error)  # raises the agreed CheckpointError if any rank's write failed
        except Exception as e:
            # The save was announced as staged: say that it never became a checkpoint.
            note = (
                f" [--async-save: iteration {iteration} was staged in memory, but its "
                "background save did not commit]"
            )
            if isinstance(e, CheckpointError):
                raise type(e)(f"{e}{note}") from e
            if isinstance(e, OSError):  # the write itself: a checkpoint error, named as one
                raise CheckpointError(f"{type(e).__name__}: {e}{note}") from e
            # Anything else (a collective that timed out, a peer gone) keeps its type, so the
            # trainer still explains it as such; the note says what it cost.
            e.add_note(note.strip())
            raise
        self._committed.append(iteration)


def _copy_into(src, cache):
    """A copy of `src` whose tensors are `cache`'s (copied into) where shape and dtype match,
    fresh clones elsewhere; plain values are shared (they are immutable or rebuilt per save)."""
    if isinstance(src, torch.Tensor):
        fits = isinstance(cache, torch.Tensor) and (cache.shape, cache.dtype) == (
            src.shape,
            src.dtype,
        )
        return cache.copy_(src.detach()) if fits else src.detach().to("cpu", copy=True)
    if isinstance(src, dict):
        old = cache if isinstance(cache, dict) else {}
        return {k: _copy_into(v, old.get(k)) for k, v in src.items()}
    if isinstance(src, list | tuple):
        old = (
            cache
            if isinstance(cache, list | tuple) and len(cache) == len(src)
            else [None] * len(src)
        )
        return type(src)(_copy_into(v, c) for v, c in zip(src, old, strict=True))
    return src
