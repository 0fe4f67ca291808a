"""Sub-millisecond wake-ups for the engine loop.

asyncio timers ride on epoll's millisecond timeout, so a plain ``asyncio.sleep`` wakes up to
~1 ms late. On Linux the engine instead arms a timerfd (nanosecond resolution,
CLOCK_MONOTONIC = ``time.monotonic``) and waits for it to become readable in the same event
loop; elsewhere it sleeps to a millisecond before the deadline and spins the rest.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import time

CLOCK_MONOTONIC = 1
TFD_NONBLOCK = 0o4000
TFD_CLOEXEC = 0o2000000
TFD_TIMER_ABSTIME = 1
SPIN_WINDOW_S = 0.0012  # the fallback's spin: epoll's rounding plus wake-up jitter


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _load_libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.timerfd_settime.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            ctypes.POINTER(_Itimerspec),
            ctypes.c_void_p,
        ]
        return libc
    except (OSError, AttributeError):
        return None


class PreciseTimer:
    """``await timer.sleep_until(t)`` for a ``time.monotonic()`` deadline ``t``."""

    def __init__(self) -> None:
        self._fd = -1
        self._libc = _load_libc()
        if self._libc is not None:
            fd = self._libc.timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC)
            self._fd = fd if fd >= 0 else -1
        self._waiter: asyncio.Future[None] | None = None
        self._registered = False

    @property
    def precise(self) -> bool:
        return self._fd >= 0

    def _arm(self, deadline: float) -> None:
        assert self._libc is not None
        sec = int(deadline)
        spec = _Itimerspec(_Timespec(0, 0), _Timespec(sec, int((deadline - sec) * 1e9)))
        if self._libc.timerfd_settime(self._fd, TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")

    def _on_readable(self) -> None:
        try:
            os.read(self._fd, 8)
        except BlockingIOError:
            return
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def sleep_until(self, deadline: float, spin: float = 0.0) -> None:
        """Wait for ``deadline``; the last ``spin`` seconds busy-wait, which beats the
        kernel's wake-up latency (~0.1-0.2 ms on a VM) when precision matters."""
        delay = deadline - time.monotonic()
        if delay <= 0:
            await asyncio.sleep(0)  # let I/O in even when the engine is behind
            return
        if not self.precise:
            if delay > SPIN_WINDOW_S:
                await asyncio.sleep(delay - SPIN_WINDOW_S)
            while time.monotonic() < deadline:
                pass
            return
        loop = asyncio.get_running_loop()
        if not self._registered:
            loop.add_reader(self._fd, self._on_readable)
            self._registered = True
        if delay > spin:
            self._waiter = loop.create_future()
            self._arm(deadline - spin)
            try:
                await self._waiter
            finally:
                self._waiter = None
        else:
            await asyncio.sleep(0)
        while time.monotonic() < deadline:
            pass

    def close(self) -> None:
        if self._fd >= 0:
            if self._registered:
                asyncio.get_event_loop().remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
