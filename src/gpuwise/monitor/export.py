"""``gpuwise watch --prometheus HOST:PORT``: the watch's figures as Prometheus metrics, named ``gpuwise_*``.

>>> from gpuwise.monitor.export import start_exporter                   # doctest: +SKIP
>>> exporter = start_exporter("9400", lambda: monitor.report())          # doctest: +SKIP
>>> exporter.url                                                         # doctest: +SKIP
'http://127.0.0.1:9400/metrics'

Served through ``prometheus_client``: a custom collector builds the metrics at scrape time from the latest
``monitor.report.Report`` that ``snapshot`` returns (nothing is pushed, nothing kept between scrapes), on its own
``CollectorRegistry`` (not the library's global one, so no process or Python metrics of ours are mixed in), by a
WSGI server on a background thread. ``PORT`` or ``:PORT`` binds the loopback address (127.0.0.1): the metrics name the
command and its figures, so other machines see them only when a host is given (then ``Exporter.note`` says so).
The address is bound when ``start_exporter`` returns: a port in use is a ``GpuwiseError`` before anything runs.

Metrics (gauges unless said; a figure the record lacks is left out, never 0):
``gpuwise_judged`` 1/0, ``gpuwise_bottleneck{class="..."}`` 1 (the diagnosis, info-style), ``gpuwise_steps_total``
(counter), ``gpuwise_step_seconds_median`` / ``_p95`` / ``_max``, ``gpuwise_samples_per_second`` (items over wall
clock), ``gpuwise_steps_per_second``, ``gpuwise_data_wait_share``, ``gpuwise_process_rss_bytes`` (and ``_peak``),
``gpuwise_allocator_allocated_bytes`` / ``_reserved_bytes``, per GPU (label ``gpu``, the NVML index)
``gpuwise_gpu_utilization_percent``, ``gpuwise_gpu_memory_used_bytes``, ``gpuwise_gpu_memory_total_bytes``,
``gpuwise_gpu_process_memory_bytes``, ``gpuwise_gpu_power_watts``, ``gpuwise_gpu_sm_clock_hertz``,
``gpuwise_gpu_temperature_celsius``; per rank (label ``rank``) ``gpuwise_rank_step_seconds_median`` and
``gpuwise_rank_exposed_comm_seconds_median``. Names follow Prometheus's conventions (base units: bytes, seconds,
hertz), as dcgm-exporter and nvitop-exporter export the same GPU counters.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from gpuwise.errors import GpuwiseError

if TYPE_CHECKING:
    from gpuwise.monitor.report import Report

LOOPBACK = "127.0.0.1"  # PORT or :PORT alone binds here: the metrics stay on this machine unless a host is given
PREFIX = "gpuwise_"
CLOSE_TIMEOUT_S = 5.0  # the server thread is joined this long at close (a scrape in flight finishes first)


# -- the metrics -------------------------------------------------------------------------------------------------


def report_metrics(report: Report) -> list[Any]:
    """The ``gpuwise_*`` metric families of one report (prometheus_client ``Metric`` objects)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    out: list[Any] = []

    def gauge(name: str, doc: str, value: float | None) -> None:
        if value is not None:
            out.append(GaugeMetricFamily(PREFIX + name, doc, value=float(value)))

    def labelled(name: str, doc: str, label: str, rows: list[tuple[str, float | None]]) -> None:
        rows = [(k, v) for k, v in rows if v is not None]
        if rows:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=[label])
            for key, value in rows:
                family.add_metric([key], float(value))  # type: ignore[arg-type]
            out.append(family)

    gauge("judged", "1 when the loop's time was judged, 0 when not (see the diagnosis for what was missing)",
          1.0 if report.judged else 0.0)
    labelled("bottleneck", "The diagnosis: 1 for the class the watch names now", "class", [(report.bottleneck, 1.0)])
    st, tp, mem = report.steps, report.throughput, report.memory
    out.append(CounterMetricFamily(PREFIX + "steps", "Optimizer steps the loop reported", value=st.count))
    gauge("step_seconds_median", "Median step time, seconds", st.median_s)
    gauge("step_seconds_p95", "95th percentile step time, seconds", st.p95_s)
    gauge("step_seconds_max", "Longest step, seconds", st.max_s)
    gauge("samples_per_second", "Items (samples or tokens) the steps consumed over wall-clock time", tp.items_per_s)
    gauge("steps_per_second", "Steps over wall-clock time", tp.steps_per_s)
    gauge("data_wait_share", "Median share of a step spent waiting for data (0-1)", st.data_wait_share_median)
    gauge("process_rss_bytes", "Resident memory of the watched process now, bytes", mem.process_rss_bytes)
    gauge("process_rss_peak_bytes", "Peak resident memory of the watched process, bytes", mem.process_rss_peak_bytes)
    gauge("allocator_allocated_bytes", "torch's caching allocator: allocated now, bytes", mem.allocator_allocated_bytes)
    gauge("allocator_reserved_bytes", "torch's caching allocator: reserved now, bytes", mem.allocator_reserved_bytes)
    gpus = report.devices_now

    def per_gpu(name: str, doc: str, key: str, scale: float = 1.0) -> None:
        labelled(name, doc, "gpu", [(str(d["index"]), None if d.get(key) is None else d[key] * scale) for d in gpus])

    per_gpu("gpu_utilization_percent", "GPU duty cycle (NVML utilization.gpu), percent", "util_pct")
    per_gpu("gpu_memory_used_bytes", "GPU memory in use, bytes", "memory_used_bytes")
    per_gpu("gpu_memory_total_bytes", "GPU memory, bytes", "memory_total_bytes")
    per_gpu("gpu_process_memory_bytes", "GPU memory the watched processes hold, bytes", "process_memory_bytes")
    per_gpu("gpu_power_watts", "GPU board power, watts", "power_w")
    per_gpu("gpu_sm_clock_hertz", "GPU SM clock, hertz", "sm_clock_mhz", 1e6)
    per_gpu("gpu_temperature_celsius", "GPU temperature, degrees Celsius", "temperature_c")
    ranks = report.ranks
    labelled("rank_step_seconds_median", "Median step time of each torch.distributed rank, seconds", "rank",
             [(str(r.rank), r.step_median_s) for r in ranks])
    labelled("rank_exposed_comm_seconds_median", "Median communication each rank waited for, seconds", "rank",
             [(str(r.rank), r.exposed_comm_median_s) for r in ranks])
    return out


class ReportCollector:
    """A prometheus_client collector: at each scrape, the metrics of ``snapshot()`` (none while it returns None,
    none when it fails: a scrape never breaks the watch)."""

    def __init__(self, snapshot: Callable[[], Report | None]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        try:
            report = self.snapshot()
            metrics = [] if report is None else report_metrics(report)
        except Exception:  # a figure that cannot be built is left out of this scrape
            metrics = []
        yield from metrics


# -- the server --------------------------------------------------------------------------------------------------


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No line per scrape on stderr: the command's output is there."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in flight never holds the process open


@dataclass
class Exporter:
    """A running endpoint: ``url`` to scrape, ``close()`` to stop it (idempotent)."""

    host: str
    port: int
    loopback: bool
    _server: Any = field(repr=False)
    _thread: threading.Thread = field(repr=False)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    @property
    def note(self) -> str | None:
        """Said once where the endpoint is reachable beyond this machine."""
        if self.loopback:
            return None
        return (f"serving metrics on {self.host}:{self.port}, not the loopback address: other machines that reach "
                "this one can read them (the command line and the GPU figures)")

    def close(self) -> None:
        if self._server is None:
            return
        with contextlib.suppress(Exception):
            self._server.shutdown()
        with contextlib.suppress(Exception):
            self._server.server_close()
        self._thread.join(timeout=CLOSE_TIMEOUT_S)
        self._server = None

    def __enter__(self) -> Exporter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_USAGE = "give HOST:PORT or PORT, e.g. --prometheus 9400 (127.0.0.1:9400) or --prometheus 0.0.0.0:9400"


def parse_address(address: str) -> tuple[str, int]:
    """``PORT``, ``:PORT``, ``HOST:PORT`` or ``[IPv6]:PORT`` -> (host, port); the host is 127.0.0.1 when left out."""
    text = str(address).strip()
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise GpuwiseError(f"bad --prometheus address {address!r}: an IPv6 host goes in brackets",
                           "write it as [::1]:9400")
    try:
        number = int(port)
    except ValueError:
        raise GpuwiseError(f"bad --prometheus address {address!r}: the port {port!r} is not a number",
                           _USAGE) from None
    if not 0 <= number <= 65535:
        raise GpuwiseError(f"bad --prometheus address {address!r}: port {number} is not 0-65535", _USAGE)
    return host or LOOPBACK, number


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def start_exporter(address: str, snapshot: Callable[[], Report | None]) -> Exporter:
    """Serve the metrics of ``snapshot()`` at ``http://HOST:PORT/metrics`` on a background thread until
    ``close()``. Port 0 takes a free one (``Exporter.port`` says which). A bad address, a port in use or one this
    user may not bind: ``GpuwiseError``, the port left free."""
    from prometheus_client import CollectorRegistry, make_wsgi_app

    host, port = parse_address(address)
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise GpuwiseError(f"bad --prometheus address {address!r}: no such host {host!r} ({exc.strerror})",
                           f"give an address of this machine: {LOOPBACK}:{port} (this machine only) or "
                           f"0.0.0.0:{port} (every interface)") from None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ReportCollector(snapshot))  # type: ignore[arg-type]
    server_class = type("_Server", (_Server,), {"address_family": family})
    try:
        server = make_server(host, port, make_wsgi_app(registry), server_class=server_class, handler_class=_Quiet)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise GpuwiseError(f"cannot serve --prometheus on {host}:{port}: the port is in use",
                               f"pick a free port (--prometheus {host}:{port + 1 if port < 65535 else 9400}) or "
                               "stop what holds it") from None
        if exc.errno == errno.EACCES:
            raise GpuwiseError(f"cannot serve --prometheus on {host}:{port}: not allowed ({exc.strerror})",
                               "pick a port above 1023, e.g. --prometheus 9400") from None
        raise GpuwiseError(f"cannot serve --prometheus on {host}:{port}: {exc.strerror or exc}",
                           f"give an address of this machine: {LOOPBACK}:{port} (this machine only) or "
                           f"0.0.0.0:{port} (every interface)") from None
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                              name="gpuwise-prometheus", daemon=True)
    thread.start()
    bound = server.server_address
    return Exporter(host=host, port=int(bound[1]), loopback=_is_loopback(host), _server=server, _thread=thread)


__all__ = ["LOOPBACK", "Exporter", "ReportCollector", "parse_address", "report_metrics", "start_exporter"]
