"""Small host values that one process computes and every process reads (`SharedValues`)."""
from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable

import jax
import numpy as np
from jax._src.distributed import global_state


class SharedValues:
    """Small host arrays that one process computes and every other one reads (the rewards of a
    micro-batch), through the coordination service's key-value store of `jax.distributed`.

    No device program is involved, so reading one adds nothing to the order in which the
    processes issue their cross-process programs (dispatch.py). Names are scoped to this
    object: every process makes its `SharedValues` at the same point of the run, so the
    scopes agree. A failure is shared too: a reader gets an error naming the process that
    failed instead of waiting for a value that never comes.
    """

    _made = 0  # objects made so far in this process: the scope of the next one
    _POLL_MS = 2000  # a reader checks this often whether the object was closed

    def __init__(self):
        SharedValues._made += 1
        self._scope = f"digen/shared/{SharedValues._made}"
        self._closed = threading.Event()
        # Readers wait on threads of their own: a reader that held a thread of the pool that
        # computes values could wait for a value of another process whose own computing thread
        # waits the same way for one of this process's.
        self._readers = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="shared-read")

    @staticmethod
    def _client():
        return global_state.client

    def publish(self, name: str, value: np.ndarray) -> None:
        self._client().key_value_set_bytes(f"{self._scope}/{name}", b"=" + np.ascontiguousarray(value).tobytes())

    def fail(self, name: str, error: BaseException) -> None:
        message = f"process {jax.process_index()} failed: {type(error).__name__}: {error}"
        self._client().key_value_set_bytes(f"{self._scope}/{name}", b"!" + message.encode())

    def read_later(self, name: str, dtype, then: Callable[[np.ndarray], Any] | None = None) -> concurrent.futures.Future:
        """The future value `name` (`read` on a reading thread), passed through `then` there if given."""
        if then is None:
            return self._readers.submit(self.read, name, dtype)
        return self._readers.submit(lambda: then(self.read(name, dtype)))

    def read(self, name: str, dtype) -> np.ndarray:
        """The value `name` as a flat array of `dtype`, once published (waits)."""
        key = f"{self._scope}/{name}"
        while True:
            if self._closed.is_set():
                raise RuntimeError(f"stopped waiting for {name}: the run is closing")
            try:
                raw = self._client().blocking_key_value_get_bytes(key, self._POLL_MS)
                break
            except Exception as e:  # noqa: BLE001 - a timeout: poll again (anything else shows in the next try)
                if "DEADLINE_EXCEEDED" not in str(e) and "deadline" not in str(e).lower():
                    raise
        if raw[:1] == b"!":
            raise RuntimeError(f"{name}: {raw[1:].decode()}")
        return np.frombuffer(raw[1:], dtype=dtype).copy()

    def share_scalars(self, name: str, values: dict[str, jax.Array], pool: concurrent.futures.Executor
                      ) -> dict[str, concurrent.futures.Future]:
        """Every process's future host copy of `values` (scalar arrays of one set of devices),
        without a device program: the lowest process holding them reads its own copy on `pool`
        once computed and publishes it; every other process reads it here. Each value keeps its
        dtype (they travel as float64, exact for the float32, integer and boolean figures)."""
        names = list(values)
        arrays = [values[n] for n in names]
        owner = min(d.process_index for x in arrays for d in x.sharding.device_set)
        if jax.process_index() == owner:
            def read_and_publish() -> list[np.ndarray]:
                try:
                    host = [np.asarray(x.addressable_shards[0].data) for x in arrays]  # scalars: whole in every shard
                except BaseException as e:
                    self.fail(name, e)
                    raise
                self.publish(name, np.array([v.item() for v in host], np.float64))
                return host
            whole = pool.submit(read_and_publish)
        else:
            whole = self._readers.submit(
                lambda: [np.asarray(v, x.dtype) for v, x in zip(self.read(name, np.float64), arrays)])
        each = {n: concurrent.futures.Future() for n in names}

        def split(done: concurrent.futures.Future) -> None:
            error = done.exception()
            for i, n in enumerate(names):
                each[n].set_exception(error) if error else each[n].set_result(done.result()[i])

        whole.add_done_callback(split)
        return each

    def close(self) -> None:
        self._closed.set()
        self._readers.shutdown(wait=True)
