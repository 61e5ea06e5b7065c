"""monitor.export: the gpuwise_* metrics of a synthetic record, scraped over HTTP and read back with prometheus_client's
own parser; addresses (loopback by default), a busy port and a bad address as one-line errors before anything runs;
and ``gpuwise watch --prometheus`` end to end, the command itself scraping the endpoint while it runs."""

from __future__ import annotations

import socket
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuwise.cli import main
from gpuwise.errors import GpuwiseError
from gpuwise.monitor.export import LOOPBACK, parse_address, report_metrics, start_exporter
from gpuwise.monitor.report import build_report
from gpuwise.monitor.rules import judge
from gpuwise.monitor.samples import DeviceSample, HostSample, Record, Sample, StepEvent
from gpuwise.monitor.verdict import Context

PY = sys.executable
MiB, GiB = 2 ** 20, 2 ** 30


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of the endpoint: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def synthetic_report():
    """30 steps of 0.1 s (every 10th 0.4 s), 16 items each, half of each step waiting on data; two GPUs, the last
    sample's readings known; RSS 200 then 300 then 250 MiB."""
    steps, t = [], 0.0
    for i in range(30):
        s = 0.4 if (i + 1) % 10 == 0 else 0.1
        t += s
        steps.append(StepEvent(step=i + 1, t=t, seconds=s, data_wait_s=s / 2, items=16))
    rss = (200, 300, 250)
    samples = tuple(Sample(t=1.0 + i, host=HostSample(process_rss_bytes=r * MiB, cpu_pct=(50.0,)), devices=(
        DeviceSample(index=0, name="NVIDIA H200", util_pct=90.0 + i, memory_used_bytes=(40 + i) * GiB,
                     memory_total_bytes=141 * GiB, process_memory_bytes=(38 + i) * GiB, power_w=500.0 + i,
                     sm_clock_mhz=1980.0 - i, temperature_c=60.0),
        DeviceSample(index=1, name="NVIDIA H200", util_pct=0.0, memory_used_bytes=GiB, memory_total_bytes=141 * GiB,
                     power_w=80.0, sm_clock_mhz=None)))
        for i, r in enumerate(rss))
    record = Record(steps=tuple(steps), samples=samples, device_kind="cuda")
    return build_report(record, judge(record, Context(device="cuda", usable_cores=8)))


def test_metrics_scraped_over_http_carry_the_reports_figures():
    report = synthetic_report()
    with start_exporter(f"{LOOPBACK}:0", lambda: report) as exporter:
        assert exporter.port > 0 and exporter.url == f"http://127.0.0.1:{exporter.port}/metrics"
        assert exporter.loopback and exporter.note is None
        got = scrape(exporter.url)
    wall = 27 * 0.1 + 3 * 0.4  # 3.9 s
    assert got[("gpuwise_steps_total", ())] == 30
    assert got[("gpuwise_step_seconds_median", ())] == pytest.approx(0.1)
    assert got[("gpuwise_step_seconds_p95", ())] == pytest.approx(0.4)  # rank 27.55 of 29: among the three stalls
    assert got[("gpuwise_step_seconds_max", ())] == pytest.approx(0.4)
    assert got[("gpuwise_samples_per_second", ())] == pytest.approx(480 / wall)
    assert got[("gpuwise_steps_per_second", ())] == pytest.approx(30 / wall)
    assert got[("gpuwise_data_wait_share", ())] == pytest.approx(0.5)
    assert got[("gpuwise_process_rss_bytes", ())] == 250 * MiB and got[("gpuwise_process_rss_peak_bytes", ())] == \
        300 * MiB
    # per GPU, the last sample's reading
    assert got[("gpuwise_gpu_utilization_percent", (("gpu", "0"),))] == 92.0
    assert got[("gpuwise_gpu_utilization_percent", (("gpu", "1"),))] == 0.0
    assert got[("gpuwise_gpu_memory_used_bytes", (("gpu", "0"),))] == 42 * GiB
    assert got[("gpuwise_gpu_process_memory_bytes", (("gpu", "0"),))] == 40 * GiB
    assert ("gpuwise_gpu_process_memory_bytes", (("gpu", "1"),)) not in got  # unknown: left out, not 0
    assert got[("gpuwise_gpu_power_watts", (("gpu", "0"),))] == 502.0
    assert got[("gpuwise_gpu_sm_clock_hertz", (("gpu", "0"),))] == pytest.approx(1978e6)
    assert ("gpuwise_gpu_sm_clock_hertz", (("gpu", "1"),)) not in got
    # the diagnosis, info-style: one series, the class named now
    classes = [k for k in got if k[0] == "gpuwise_bottleneck"]
    assert classes == [("gpuwise_bottleneck", (("class", report.bottleneck),))] and got[classes[0]] == 1
    assert got[("gpuwise_judged", ())] == (1.0 if report.judged else 0.0) == 1.0
    assert all(name.startswith("gpuwise_") for name, _ in got)  # its own registry: no process_* or python_*


def test_a_not_judged_report_says_judged_0_and_per_rank_metrics_appear_with_ranks():
    no_steps = Record(samples=tuple(Sample(t=i * 0.5, host=HostSample(cpu_pct=(10.0,))) for i in range(8)))
    values = {m.name: m.samples[0].value for m in report_metrics(build_report(no_steps, judge(no_steps)))}
    assert values["gpuwise_judged"] == 0.0
    ranked = Record(steps=tuple(StepEvent(step=i // 2 + 1, t=0.1 * (i // 2 + 1), seconds=0.1, rank=i % 2,
                                          exposed_comm_s=0.03 * (1 - i % 2)) for i in range(20)))
    fams = {m.name: m for m in report_metrics(build_report(ranked, judge(ranked)))}
    per = {s.labels["rank"]: s.value for s in fams["gpuwise_rank_exposed_comm_seconds_median"].samples}
    assert per == pytest.approx({"0": 0.03, "1": 0.0})


def test_no_report_yet_and_a_failing_snapshot_serve_an_empty_page_not_an_error():
    def broken():
        raise RuntimeError("boom")

    for snapshot in (lambda: None, broken):
        with start_exporter("127.0.0.1:0", snapshot) as exporter:
            assert scrape(exporter.url) == {}


def test_addresses_default_to_loopback_and_bad_ones_are_one_line_errors():
    assert parse_address("9400") == ("127.0.0.1", 9400)
    assert parse_address(":9400") == ("127.0.0.1", 9400)
    assert parse_address("0.0.0.0:9400") == ("0.0.0.0", 9400)
    assert parse_address("[::1]:9400") == ("::1", 9400)
    assert parse_address("localhost:0") == ("localhost", 0)
    for bad, why in (("abc", "not a number"), ("1.2.3.4:99999", "not 0-65535"), ("::1:9400", "brackets"),
                     ("host:", "not a number")):
        with pytest.raises(GpuwiseError, match=why) as info:
            parse_address(bad)
        assert "\n" not in str(info.value)


def test_a_busy_port_and_an_address_not_of_this_machine_are_refused():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(GpuwiseError, match="in use") as info:
            start_exporter(f"127.0.0.1:{port}", lambda: None)
        assert "pick a free port" in info.value.hint
    with pytest.raises(GpuwiseError, match="cannot serve"):
        start_exporter("192.0.2.1:0", lambda: None)  # TEST-NET-1: never an address of this machine


def test_every_interface_is_allowed_but_said_and_close_frees_the_port():
    exporter = start_exporter("0.0.0.0:0", lambda: None)
    try:
        assert not exporter.loopback and "other machines" in exporter.note
        port = exporter.port
        assert scrape(f"http://127.0.0.1:{port}/metrics") == {}
    finally:
        exporter.close()
    exporter.close()  # twice: nothing
    assert listen_again("0.0.0.0", port)  # the port is free once closed


def listen_again(host: str, port: int) -> bool:
    """Can a new server listen on the port? (SO_REUSEADDR, as servers bind: a connection the server closed lingers in
    TIME_WAIT, which only a listening socket, not that, refuses.)"""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen()
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SCRAPER = """
import sys, time, urllib.request
from gpuwise.monitor.sampler import Monitor

with Monitor(interval_s=0.05, gpus=False) as m:
    for _ in range(12):
        time.sleep(0.02)
        m.step(items=4)
time.sleep(1.0)  # the watch reads the events file within 0.1 s
page = urllib.request.urlopen(sys.argv[1], timeout=10).read().decode()
print(page)
"""


def test_watch_prometheus_serves_the_running_commands_figures(capfd):
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    code = main(["watch", "--interval", "0.05", "--prometheus", f"127.0.0.1:{port}", "--", PY, "-c", SCRAPER, url])
    out, err = capfd.readouterr()
    assert code == 0, err
    assert f"metrics for Prometheus at {url}" in err
    page = out[:out.index("gpuwise watch")] if "gpuwise watch" in out else out
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(page) for s in f.samples}
    assert got[("gpuwise_steps_total", ())] == 12  # the loop's steps, read from its events while it ran
    assert got[("gpuwise_process_rss_bytes", ())] > 10 * MiB  # the command's own memory
    assert ("gpuwise_judged", ()) in got and any(k[0] == "gpuwise_bottleneck" for k in got)
    assert listen_again("127.0.0.1", port)  # closed when the watch ended


def test_watch_prometheus_on_a_busy_port_exits_2_before_the_command_runs(tmp_path, capfd):
    marker = tmp_path / "ran"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code = main(["watch", "--prometheus", str(port), "--", PY, "-c", f"open({str(marker)!r}, 'w').close()"])
    assert code == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: ") and "in use" in err[0]
    assert not marker.exists()
    assert main(["watch", "--prometheus", "nope", "--", PY, "-c", "pass"]) == 2


def test_a_monitor_in_the_loop_serves_its_metrics_while_it_runs():
    import urllib.request

    from gpuwise.monitor.sampler import Monitor

    with Monitor(interval_s=0.05, gpus=False, prometheus="127.0.0.1:0") as mon:
        for _ in range(6):
            mon.step(seconds=0.01, items=8)
        body = urllib.request.urlopen(mon.metrics_url, timeout=10).read().decode()
    assert "gpuwise_steps_total 6.0" in body and "gpuwise_judged" in body
    assert mon.metrics_url is None  # closed with the monitor
