"""The run's console log, ``<logger.log_dir>/console.log``: everything the driver prints and every line its Ray
workers print, while the terminal of a quiet run (``logger.verbose: false``) shows only what a user needs.

A quiet terminal shows the driver's own lines (the precision line, one "starting N workers" line, the progress bar,
the step lines, its warnings and errors), worker lines that report an error (a traceback, an ``ERROR`` /
``CRITICAL`` record, an ``...Error:`` line, and the lines that follow them from the same worker within
:data:`ERROR_TAIL_S`) and Ray's own records at ERROR or above; the workers' other output, Ray's INFO / WARNING
records and :func:`log_only` lines go to ``console.log`` only. ``logger.verbose: true`` shows all of it on the
terminal too; the file is written either way.

Mechanism: the driver's ``sys.stdout`` / ``sys.stderr`` become tees into the file (:class:`ConsoleLog`); Ray's
handler that prints worker output in the driver is replaced by :meth:`ConsoleLog.on_worker_output`, which writes
every batch to the file and passes the chosen ones to Ray's own printer; a filter on the ``ray`` logger's handlers
sends records below ERROR to the file only.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

CONSOLE_LOG = "console.log"
"""File name of the console log inside ``logger.log_dir``."""

ERROR_LINE = re.compile(
    r"Traceback \(most recent call last\)|\b(?:ERROR|CRITICAL|FATAL)\b|"
    r"^\s*(?:[\w.]+\.)?\w*(?:Error|Exception)(?::|$)|Segmentation fault|core dumped"
)
"""A worker line that reports an error: its batch (and what follows, :data:`ERROR_TAIL_S`) reaches the terminal."""
ERROR_TAIL_S = 2.0
"""Seconds after a worker's error line during which its further lines also reach the terminal (the rest of a
traceback that Ray delivered in a later batch)."""

_active: ConsoleLog | None = None


class _Tee:
    """A text stream that writes to ``stream`` (the terminal) and to the console log; everything else (``fileno``,
    ``isatty``, ``encoding``) is the terminal stream's."""

    def __init__(self, stream: TextIO, log: ConsoleLog) -> None:
        self._stream, self._log = stream, log

    def write(self, text: str) -> int:
        """Write ``text`` to the terminal stream and the log file."""
        self._log.write_file(text)
        return self._stream.write(text)

    def flush(self) -> None:
        """Flush the terminal stream (the log file is line-buffered)."""
        self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


class _RayRecordsToFile(logging.Filter):
    """On a handler of the ``ray`` logger: records below ERROR go to the console log only (False: not printed)."""

    def __init__(self, log: ConsoleLog) -> None:
        super().__init__()
        self.log = log

    def filter(self, record: logging.LogRecord) -> bool:
        """True (print) for ERROR and above; else write the record to the file and return False."""
        if record.levelno >= logging.ERROR:
            return True
        self.log.write_file(f"{record.levelname} {record.name}: {record.getMessage()}\n")
        return False


class ConsoleLog:
    """The console log of one driver process (see the module docstring).

    Args:
        log_dir: ``logger.log_dir`` (created); the file is ``<log_dir>/console.log``, appended to (a resumed run
            continues it).
        verbose: ``logger.verbose``: every worker line and Ray record also reaches the terminal.
    """

    def __init__(self, log_dir: str | Path, verbose: bool) -> None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(log_dir) / CONSOLE_LOG
        self.verbose = verbose
        self._file = open(self.path, "a", buffering=1, encoding="utf-8", errors="replace")
        self._lock = threading.Lock()
        self._terminal = (sys.stdout, sys.stderr)
        self._last_error: dict[object, float] = {}
        self._ray_filters: list[tuple[logging.Handler, logging.Filter]] = []

    def write_file(self, text: str) -> None:
        """Append ``text`` to the log file (thread-safe: Ray's log thread writes too)."""
        with self._lock:
            if not self._file.closed:
                self._file.write(text)

    def start(self) -> ConsoleLog:
        """Tee ``sys.stdout`` / ``sys.stderr`` into the file. Returns self."""
        sys.stdout, sys.stderr = _Tee(self._terminal[0], self), _Tee(self._terminal[1], self)
        return self

    def quiet_ray_records(self) -> None:
        """When quiet, send the ``ray`` logger's records below ERROR to the file only (call after Ray is imported,
        before ``ray.init``, whose own notices they are). Verbose: nothing to do (they reach both through the tee)."""
        if self.verbose or self._ray_filters:
            return
        for handler in logging.getLogger("ray").handlers:
            flt = _RayRecordsToFile(self)
            handler.addFilter(flt)
            self._ray_filters.append((handler, flt))

    def to_terminal(self, data: dict) -> bool:
        """Whether a batch of worker output (Ray's dict: ``lines``, ``pid``, ``is_err`` ...) reaches the terminal:
        always when verbose; when quiet, Ray's raylet messages (e.g. a worker killed for memory), a
        batch with an :data:`ERROR_LINE`, and the same worker's batches within :data:`ERROR_TAIL_S` of one."""
        if self.verbose or data.get("pid") == "raylet":
            return True
        source, now = (data.get("ip"), data.get("pid")), time.monotonic()
        if any(ERROR_LINE.search(line) for line in data.get("lines", [])):
            self._last_error[source] = now
            return True
        return now - self._last_error.get(source, -ERROR_TAIL_S) < ERROR_TAIL_S

    def on_worker_output(self, data: dict) -> None:
        """Ray's stdstream handler: every line of the batch to the file (prefixed like Ray's, ``(Actor pid=N)``),
        the batch to the terminal per :meth:`to_terminal`. The autoscaler's batches (its whole log, every 5 s) are
        cut to their events, as Ray's own printer does, and go to both."""
        if data.get("pid") == "autoscaler":
            events = "".join(f"(autoscaler) {line}\n" for line in _autoscaler_events(data.get("lines", [])))
            self.write_file(events)
            self._terminal[1].write(events)
            return
        prefix = f"({data.get('actor_name') or data.get('task_name') or 'worker'} pid={data.get('pid')})"
        self.write_file("".join(f"{prefix} {line}\n" for line in data.get("lines", [])))
        if self.to_terminal(data):
            _print_to_terminal(data, self._terminal[1] if data.get("is_err") else self._terminal[0])

    def route_ray_worker_output(self) -> bool:
        """Replace Ray's printer of worker output in this driver with :meth:`on_worker_output` (call after
        ``ray.init(log_to_driver=True)``). False, leaving Ray's printer, when this Ray has no such hook."""
        try:
            # lazy: Ray internals, once output is routed
            from ray._private.worker import (
                global_worker_stdstream_dispatcher as dispatcher,  # lazy: Ray internals, once output is routed
            )
        except ImportError:
            return False
        dispatcher.remove_handler("ray_print_logs")
        dispatcher.add_handler("ray_print_logs", self.on_worker_output)
        return True

    def close(self) -> None:
        """Restore ``sys.stdout`` / ``sys.stderr`` and the Ray handlers, close the file."""
        sys.stdout, sys.stderr = self._terminal
        for handler, flt in self._ray_filters:
            handler.removeFilter(flt)
        with self._lock:
            self._file.close()


def _autoscaler_events(lines: list[str]) -> list[str]:
    """The event lines of an autoscaler batch (Ray's filter; none when this Ray lacks it)."""
    try:
        from ray._private.worker import filter_autoscaler_events  # lazy: Ray internals, once output is routed
    except ImportError:
        return []
    return list(filter_autoscaler_events(lines))


def _print_to_terminal(data: dict, stream: TextIO) -> None:
    """Print a worker batch on the terminal as Ray does (prefix, colour, de-duplication across workers)."""
    try:
        from ray._private.worker import (  # lazy: Ray internals, once output is routed
            print_worker_logs,
            stderr_deduplicator,
            stdout_deduplicator,
        )
    except ImportError:
        stream.writelines(f"(pid={data.get('pid')}) {line}\n" for line in data.get("lines", []))
        return
    dedup = stderr_deduplicator if data.get("is_err") else stdout_deduplicator
    for batch in dedup.deduplicate(data):
        print_worker_logs(batch, stream)


def open_console_log(log_dir: str | Path, verbose: bool) -> ConsoleLog:
    """Start this process's :class:`ConsoleLog` (closing a previous one); :func:`active_console_log` returns it."""
    global _active
    close_console_log()
    _active = ConsoleLog(log_dir, verbose).start()
    return _active


def active_console_log() -> ConsoleLog | None:
    """The console log :func:`open_console_log` started in this process, or None."""
    return _active


def close_console_log() -> None:
    """Close the active console log, if any."""
    global _active
    if _active is not None:
        _active.close()
        _active = None


def log_only(line: str) -> None:
    """A line for the console log only when a quiet console log is active (e.g. where each actor runs); printed
    (and so also logged) otherwise."""
    if _active is not None and not _active.verbose:
        _active.write_file(line + "\n")
    else:
        print(line, flush=True)
