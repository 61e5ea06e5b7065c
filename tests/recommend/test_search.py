"""gpuwise recommend: the user's prices, goals and limits, and the ranking of real captures on catalog rows."""

from __future__ import annotations

import itertools
import json
import math
import re

import pytest

from conftest import run_cli
from gpuwise.cli.recommend import parse_duration
from gpuwise.errors import GpuwiseError
from gpuwise.hardware.catalog import load_catalog
from gpuwise.recommend.prices import Price, read_prices
from gpuwise.recommend.request import Constraints, Goal


def test_prices_file_is_read_by_any_catalog_name_with_its_date(tmp_path):
    f = tmp_path / "quotes.csv"
    f.write_text("gpu,rent_usd_per_hour,buy_usd,date\nRTX 4090,0.55,1800,2026-11-20\nh100,2.10,,2026-11\n\n")
    rent, buy = read_prices(f)
    assert rent["rtx-4090"] == Price(usd=0.55, source="your quote (quotes.csv)", date="2026-11-20")
    assert buy["rtx-4090"].usd == 1800 and "h100-sxm" not in buy
    assert rent["h100-sxm"].usd == 2.10


@pytest.mark.parametrize(("text", "message"), [
    ("name,price\nrtx-4090,1\n", "the first line must be gpu,rent_usd_per_hour,buy_usd"),
    ("gpu,rent_usd_per_hour\nrtx-9999,1\n", "line 2: unknown GPU 'rtx-9999'"),
    ("gpu,rent_usd_per_hour\nrtx-4090,-1\n", "line 2: rent_usd_per_hour '-1' is not a positive number"),
    ("gpu,rent_usd_per_hour\nrtx-4090,cheap\n", "line 2: rent_usd_per_hour 'cheap' is not a positive number"),
    ("gpu,buy_usd,date\nrtx-4090,1500,last week\n", "line 2: date 'last week' is not YYYY-MM-DD"),
    ("", "the first line must be"),
    # issue 30: a decimal comma read as $99 silently; now refused, either way it splits
    ("gpu,rent_usd_per_hour,buy_usd\nh100,2,99\n", "line 2: buying h100-sxm for $99 costs less than 100 hours of "
                                                    "its rent ($2/h): a decimal comma"),
    ("gpu,rent_usd_per_hour,buy_usd\nrtx-4090,0,69,1599\n", "line 2: 4 cells for the header's 3 columns"),
])
def test_a_malformed_prices_file_is_one_line_naming_the_line(tmp_path, text, message):
    f = tmp_path / "p.csv"
    f.write_text(text)
    with pytest.raises(GpuwiseError, match=re.escape(message)):
        read_prices(f)


def test_goal_and_limits_refuse_nonsense():
    with pytest.raises(GpuwiseError, match="--tokens -5 is not a positive number"):
        Goal(tokens=-5)
    with pytest.raises(GpuwiseError, match="--tokens and --samples both"):
        Goal(tokens=1, samples=1)
    with pytest.raises(GpuwiseError, match="--samples nan"):
        Goal(samples=math.nan)
    with pytest.raises(GpuwiseError, match="--budget -1"):
        Constraints(budget_usd=-1)
    with pytest.raises(GpuwiseError, match="--max-gpus 0 is outside"):
        Constraints(max_gpus=0)
    with pytest.raises(GpuwiseError, match="unknown --segment 'gaming'"):
        Constraints(segments=("gaming",))


def test_durations_read_as_people_write_them():
    assert parse_duration("36h") == 36 * 3600
    assert parse_duration("3d") == 3 * 86400
    assert parse_duration("90min") == 5400
    assert parse_duration("120") == 120
    with pytest.raises(GpuwiseError, match="--deadline 'soon' is not a duration"):
        parse_duration("soon")


@pytest.mark.parametrize(("args", "message"), [
    (["--gpu", "rtx-9999"], "unknown GPU 'rtx-9999'"),
    (["--tokens", "-1"], "--tokens -1 is not a positive number"),
    (["--deadline", "tomorrow"], "--deadline 'tomorrow' is not a duration"),
    (["--epochs", "3"], "--epochs and --dataset-size go together"),
    (["--sort", "fastest"], "--sort 'fastest' is not one of"),
    (["--plot", "out.jpg"], "the picture is a PNG"),
    (["--serve", "--weights", "int3"], "--weights 'int3' is not one of"),
    (["--serve", "--tpot-ms", "-5"], "--tpot-ms -5 is not a positive number"),
    (["--serve", "--checkpointing", "full"], "--checkpointing has no meaning when serving"),
    (["--serve", "--concurrency", "0"], "--concurrency 0 is outside 1.."),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, message):
    workload = ["--seq", "64", "--batch", "8"] if "--serve" not in args else []
    code, out, err = run_cli(capsys, "recommend", "--model", "gpt2", *workload, "--gpu", "rtx-4090", *args)
    assert code == 2, out + err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_malformed_prices_file_exits_2_from_the_cli(capsys, tmp_path):
    f = tmp_path / "p.csv"
    f.write_text("gpu,rent_usd_per_hour\n4090,free\n")
    code, _, err = run_cli(capsys, "recommend", "--model", "gpt2", "--prices", str(f))
    assert code == 2 and "line 2: rent_usd_per_hour 'free' is not a positive number" in err


def test_every_catalog_row_with_a_rent_has_a_dated_source():
    """The rent the ranking multiplies by is shown with where and when it was quoted."""
    for acc in load_catalog():
        if acc.cloud_usd_per_hour:
            assert acc.cloud_price_source and acc.cloud_price_date, acc.key


# -- the ranking, on real captures (a small GPT, a few GPUs, so each test takes seconds) -----------------------

FEW = "rtx-3060-12gb,rtx-4060-ti-16gb,rtx-4090,a100-80gb-sxm,h100-sxm,t4"


@pytest.fixture(scope="module")
def ranked():
    from gpuwise.planning.setup import Setup
    from gpuwise.planning.sources.resolve import resolve_source
    from gpuwise.recommend.search import recommend

    catalog = load_catalog()
    keys = tuple(catalog.get(k).key for k in FEW.split(","))
    quotes = {"t4": Price(usd=0.35, source="test quote", date="2026-11")}
    return recommend(resolve_source("gpt2", None), Setup.for_batch(batch=32, micro_batch=32, seq=256),
                     Goal(tokens=1e9), Constraints(gpus=keys, rent=quotes), catalog=catalog)


def test_each_row_fits_its_gpu_and_keeps_the_global_batch(ranked):
    assert ranked.rows and ranked.unit == "tokens"
    for o in ranked.rows:
        assert o.fits and o.setup.batch == 32 and o.setup.gpus == o.count
        assert o.time_to_goal_s == pytest.approx(1e9 / o.throughput)
        assert o.throughput == pytest.approx(32 * 256 / o.step_time_s)  # tokens per step over the step time


def test_a_job_costs_what_the_quotes_and_the_board_power_say():
    """Eight H100 SXM (700 W each, NVIDIA's datasheet) for 10 hours at a quoted $2.50 a GPU-hour and $25,000 a GPU,
    doing 100k tokens a second: worked by hand."""
    from gpuwise.recommend.prices import costs

    h100 = load_catalog().get("h100-sxm")
    rent, buy = Price(usd=2.50, source="q"), Price(usd=25_000, source="q")
    c = costs(h100, gpus=8, throughput=1e5, hours=10.0, rent={"h100-sxm": rent}, buy={"h100-sxm": buy})
    assert (c.rent_usd_per_hour, c.buy_price) == (rent, buy)
    assert c.rent_usd == pytest.approx(200.0) and c.buy_usd == pytest.approx(200_000.0)
    assert c.energy_kwh == pytest.approx(56.0)  # 5.6 kW for 10 h
    assert c.per_joule == pytest.approx(17.857, rel=1e-4)  # 100k tokens/s over 5600 W
    none = costs(h100, gpus=8, throughput=1e5, hours=None, rent={}, buy={})  # no goal: no job figures
    assert none.rent_usd is None and none.energy_kwh is None
    # no quote: the cheapest on-demand cloud offer in instances of up to 8 (the snapshot: Cudo's 1-GPU H100, $1.8214/h)
    assert (none.rent_usd_per_hour.provider, none.rent_usd_per_hour.usd) == ("cudo", pytest.approx(1.8214))


def test_the_rows_use_the_users_quote_and_the_precision_the_gpu_has(ranked):
    t4 = [o for o in ranked.rows if o.gpu == "t4"]
    assert t4 and all(o.rent_usd_per_hour.usd == 0.35 and o.rent_usd_per_hour.source == "test quote" for o in t4)
    assert all(o.setup.precision == "fp16-mixed" for o in t4)  # no bf16 on Turing: autocast to fp16 with a scaler


def test_the_pareto_front_is_what_nothing_beats_on_both_time_and_cost(ranked):
    priced = [o for o in ranked.rows if o.rent_usd is not None]
    for o in priced:
        beaten = any(p.time_to_goal_s <= o.time_to_goal_s and p.rent_usd <= o.rent_usd and
                     (p.time_to_goal_s < o.time_to_goal_s or p.rent_usd < o.rent_usd) for p in priced)
        assert o.pareto == (not beaten), o


def test_a_rows_rent_and_energy_are_for_every_gpu_it_holds(ranked):
    """Per hour of the job, 8 x H100 draw 8 times what one does and rent 8 GPU-hours (at the price for an instance of
    that size): the row's costs are for all its GPUs."""
    h100 = {o.count: o for o in ranked.rows if o.gpu == "h100-sxm"}
    for n in (1, 2, 4, 8):
        hours = h100[n].time_to_goal_s / 3600
        assert h100[n].rent_usd == pytest.approx(n * h100[n].rent_usd_per_hour.usd * hours, rel=1e-9)
        per_hour = h100[n].energy_kwh / h100[n].time_to_goal_s
        assert per_hour == pytest.approx(n * h100[1].energy_kwh / h100[1].time_to_goal_s, rel=1e-9)


def test_more_datacenter_gpus_go_faster_and_an_h100_beats_a_4090(ranked):
    h100 = sorted((o for o in ranked.rows if o.gpu == "h100-sxm"), key=lambda o: o.count)
    assert [o.count for o in h100] == [1, 2, 4, 8]
    assert all(a.throughput < b.throughput for a, b in itertools.pairwise(h100))
    one = {o.gpu: o for o in ranked.rows if o.count == 1}
    assert one["h100-sxm"].throughput > one["rtx-4090"].throughput > one["rtx-3060-12gb"].throughput


def test_budget_and_deadline_move_rows_out_with_the_reason():
    from gpuwise.planning.setup import Setup
    from gpuwise.planning.sources.resolve import resolve_source
    from gpuwise.recommend.search import recommend

    r = recommend(resolve_source("gpt2", None), Setup.for_batch(batch=32, micro_batch=32, seq=256), Goal(tokens=1e9),
                  Constraints(gpus=("rtx-4090", "h100-sxm"), budget_usd=3.5, deadline_s=3 * 3600))
    assert r.rows and all(o.rent_usd <= 3.5 and o.time_to_goal_s <= 3 * 3600 for o in r.rows)
    reasons = {o.excluded.split(":")[0] for o in r.excluded}
    assert reasons <= {"over budget", "misses the deadline"} and reasons


def test_json_has_the_fields_the_issue_names(capsys):
    code, out, err = run_cli(capsys, "recommend", "--model", "gpt2", "--seq", "128", "--batch", "8", "--tokens", "1e8",
                             "--gpu", "rtx-4090", "--max-gpus", "2", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert set(data) >= {"workload", "goal", "rows"}
    row = data["rows"][0]
    assert set(row) >= {"gpu", "count", "fits", "flags", "step_time_s", "tokens_per_s", "mfu", "time_to_goal_s",
                        "rent_usd", "buy_usd", "energy_kwh", "tokens_per_joule", "pareto", "basis", "excluded"}
    assert {r["count"] for r in data["rows"]} == {1, 2}
    # --gpus (the issue's spelling) is --gpu: the same filter, any catalog name or alias
    code, out, err = run_cli(capsys, "recommend", "--model", "gpt2", "--seq", "128", "--batch", "8", "--tokens",
                             "1e8", "--gpus", "RTX 4090, h100", "--max-gpus", "1", "--json")
    assert code == 0, err
    assert {r["gpu"] for r in json.loads(out)["rows"]} == {"rtx-4090", "h100-sxm"}


def test_an_inference_chip_is_left_out_of_training_with_the_reason(capsys):
    code, out, _ = run_cli(capsys, "recommend", "--model", "gpt2", "--seq", "64", "--batch", "4", "--tokens", "1e6",
                           "--gpu", "coral-edge-tpu", "--json")
    assert code == 1  # nothing to recommend: the JSON still says why
    (row,) = json.loads(out)["rows"]
    assert not row["fits"] and "inference chip" in row["excluded"]


# -- serving ---------------------------------------------------------------------------------------------------

def _catalog(*keys):
    from gpuwise.hardware.catalog import Catalog

    full = load_catalog()
    return Catalog(tuple(full.get(k) for k in keys))


def test_a_70b_model_needs_datacenter_memory_and_tensor_parallel_when_serving():
    from gpuwise.planning.sources.resolve import resolve_source
    from gpuwise.recommend.request import Traffic
    from gpuwise.recommend.serve import serve

    catalog = _catalog("rtx-4090", "a100-80gb-sxm", "h100-sxm", "h200")
    free = serve(resolve_source("llama2-70b", None), Traffic(concurrency=100), catalog=catalog)
    assert {o.gpu for o in free.excluded} == {"rtx-4090"}  # 4 x 24 GiB cannot hold 138 GB of bf16 weights
    a100 = [o for o in free.rows if o.gpu == "a100-80gb-sxm"]
    assert min(o.count for o in a100) == 2  # 2 x 80 GiB is the smallest replica that holds the weights
    r = serve(resolve_source("llama2-70b", None), Traffic(concurrency=100, tpot_s=0.025), catalog=catalog)
    assert r.rows and len(r.rows) < len(free.rows)  # the latency target rules some replicas out
    for o in r.rows:  # within the latency target, and enough sequences in flight for every user
        assert o.step_time_s <= 0.025
        assert o.throughput >= 100 * o.per_user * (1 - 1e-9)
        # a second replica only when one cannot hold them all, or not within the target
        assert o.replicas == 1 or o.max_concurrency < 100 or o.decode_batch < 100
    # memory-bound decode: at equal GPUs the faster memory gives more tokens per user
    two = {o.gpu: o for o in free.rows if o.count == 2}
    assert two["h200"].per_user > two["a100-80gb-sxm"].per_user


def test_quantised_weights_fit_where_bf16_does_not_and_decode_faster():
    from gpuwise.planning.sources.resolve import resolve_source
    from gpuwise.recommend.request import Traffic
    from gpuwise.recommend.serve import serve

    src, cat = resolve_source("llama3-8b", None), _catalog("rtx-3060-12gb", "rtx-4090")
    bf16 = serve(src, Traffic(), catalog=cat)
    int4 = serve(src, Traffic(weights="int4"), catalog=cat)
    assert "rtx-3060-12gb" in {o.gpu for o in bf16.excluded}  # 16 GB of weights on a 12 GB card
    assert any(o.gpu == "rtx-3060-12gb" and o.count == 1 for o in int4.rows)
    b, q = ({o.gpu: o for o in x.rows if o.count == 1}["rtx-4090"] for x in (bf16, int4))
    assert 2 < q.per_user / b.per_user < 4  # ~3.8x fewer bytes a token, plus the fixed per-token cost


def test_edge_chips_rank_by_work_per_joule_for_a_small_int8_vision_model(capsys):
    code, out, err = run_cli(capsys, "recommend", "--model", "mobilenet-v2", "--serve", "--weights", "int8",
                             "--gpu", "coral-edge-tpu,jetson-agx-orin,rtx-4090", "--sort", "energy", "--json")
    assert code == 0, err
    rows = [r for r in json.loads(out)["rows"] if r["fits"]]
    assert rows[0]["gpu"] == "coral-edge-tpu"  # 4 TOPS at 2 W
    assert rows == sorted(rows, key=lambda r: -(r["samples_per_joule"] or 0))


def test_ascend_is_listed_unless_the_user_asks_for_cuda_only():
    from gpuwise.planning.setup import Setup
    from gpuwise.planning.sources.resolve import resolve_source
    from gpuwise.recommend.search import recommend

    src, setup, goal = resolve_source("gpt2", None), Setup.for_batch(batch=8, micro_batch=8, seq=128), Goal(tokens=1e8)
    cat = _catalog("ascend-910b", "a100-80gb-sxm")
    anyone = recommend(src, setup, goal, Constraints(max_gpus=1), catalog=cat)
    (ascend,) = [o for o in anyone.excluded if o.gpu == "ascend-910b"]  # listed, with why it cannot be costed:
    assert "memory bandwidth" in ascend.excluded  # Huawei publishes no bandwidth figure for the 910B
    cuda = recommend(src, setup, goal, Constraints(max_gpus=1, ecosystem="cuda"), catalog=cat)
    assert {o.gpu for o in cuda.rows} | {o.gpu for o in cuda.excluded} == {"a100-80gb-sxm"}


def test_the_plot_draws_time_against_cost_to_a_png(capsys, tmp_path):
    png = tmp_path / "rank.png"
    code, out, err = run_cli(capsys, "recommend", "--model", "gpt2", "--seq", "128", "--batch", "8", "--tokens", "1e8",
                             "--gpu", "rtx-4090,h100-sxm", "--max-gpus", "2", "--plot", str(png))
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"drawn to {png}" in out


def test_the_guide_is_the_engines_own_ranking_of_each_job(monkeypatch):
    """With no workload: each job's picks are the extremes of the same ranking (not typed in). The jobs run here,
    one after another, with the session's captures, which the README's bare ``gpuwise recommend`` (test_readme.py)
    ranks again in its worker processes: the two capture the jobs' models once."""
    import gpuwise.environment
    from gpuwise.recommend.guide import guide

    monkeypatch.setattr(gpuwise.environment, "usable_cores", lambda: 1)  # no worker processes: the same scenarios
    cat = _catalog("rtx-4090", "h100-sxm", "coral-edge-tpu", "jetson-agx-orin")
    g = guide(catalog=cat)
    assert len(g.scenarios) == 6
    learn, *_, serve70, edge = g.scenarios
    assert learn.fastest is not None and learn.fastest.gpu == "h100-sxm"
    assert learn.cheapest is not None and learn.cheapest.rent_usd <= learn.fastest.rent_usd
    assert serve70.fastest.gpu == "h100-sxm" and serve70.fastest.step_time_s <= 0.04  # the 4090s cannot hold 70B
    assert edge.most_per_joule.gpu == "coral-edge-tpu"
    for s in g.scenarios:
        assert s.command.startswith("gpuwise recommend --model ")


def test_learning_on_a_3060_or_a_4060_ti_is_the_known_trade_off():
    """Both hold a small GPT; the 4060 Ti's tensor cores train it faster, the 3060's wider bus (360 vs 288 GB/s)
    decodes faster: the split the buying guides describe."""
    from gpuwise.planning.setup import Setup
    from gpuwise.planning.sources.resolve import resolve_source
    from gpuwise.recommend.request import Traffic
    from gpuwise.recommend.search import recommend
    from gpuwise.recommend.serve import serve

    cat = _catalog("rtx-3060-12gb", "rtx-4060-ti-16gb")
    train = recommend(resolve_source("gpt2", None), Setup.for_batch(batch=8, micro_batch=8, seq=512), Goal(tokens=1e8),
                      Constraints(max_gpus=1), catalog=cat)
    t = {o.gpu: o for o in train.rows}
    assert set(t) == {"rtx-3060-12gb", "rtx-4060-ti-16gb"}
    assert t["rtx-4060-ti-16gb"].throughput > t["rtx-3060-12gb"].throughput
    decode = {o.gpu: o for o in serve(resolve_source("llama3.2-1b", None), Traffic(), Constraints(max_gpus=1),
                                      catalog=cat).rows}
    assert decode["rtx-3060-12gb"].per_user > decode["rtx-4060-ti-16gb"].per_user


def test_lora_and_qlora_of_a_7b_model_fit_one_4090():
    """The guide's LoRA job (batch 16 x 2,048 tokens), whose captures the session has from the guide's test above."""
    from gpuwise.planning.setup import Setup
    from gpuwise.planning.sources.resolve import resolve_source
    from gpuwise.recommend.search import recommend

    for qlora in (False, True):
        setup = Setup.for_batch(batch=16, micro_batch=16, seq=2048, task="finetune-lora", qlora=qlora)
        r = recommend(resolve_source("llama2-7b", None), setup, Goal(tokens=1e7), Constraints(max_gpus=1),
                      catalog=_catalog("rtx-4090"))
        (row,) = r.rows
        assert row.count == 1 and row.setup.task == "finetune-lora" and row.setup.qlora == qlora


@pytest.mark.parametrize(("args", "message"), [
    (["--seq", "64", "--deadline", "3d"], "--deadline is judged against a goal"),
    (["--seq", "64", "--budget", "100"], "--budget is judged against a goal"),
    (["--seq", "64", "--tpot-ms", "40"], "--tpot-ms applies to serving"),
    (["--seq", "64", "--concurrency", "1"], "--concurrency applies to serving"),  # its default value too
    (["--serve", "--batch", "4"], "--batch does not apply to serving a language model"),
    (["--serve", "--prompt-tokens", "1000", "--output-tokens", "100"], "1100 is more than gpt2's 1024 positions"),
    (["--serve", "--vendor", "nvidai"], "unknown --vendor 'nvidai'"),
    (["--serve", "--ecosystem", "cud"], "unknown --ecosystem 'cud'"),
])
def test_limits_without_a_goal_and_flags_of_the_other_mode_are_refused(capsys, args, message):
    code, _, err = run_cli(capsys, "recommend", "--model", "gpt2", "--gpu", "rtx-4090", *args)
    assert code == 2 and message in err, err


def test_a_prices_file_saved_by_excel_or_not_a_csv_at_all(tmp_path):
    bom = tmp_path / "excel.csv"
    bom.write_bytes("gpu,rent_usd_per_hour\nrtx-4090,0.5\n".encode("utf-8-sig"))
    assert read_prices(bom)[0]["rtx-4090"].usd == 0.5
    binary = tmp_path / "quotes.xlsx"
    binary.write_bytes(b"PK\x03\x04\xff\xfe\x00\x00binary")
    with pytest.raises(GpuwiseError, match="is not a text CSV file"):
        read_prices(binary)


def test_serving_splits_heads_evenly_and_leaves_npus_out_of_decode():
    from gpuwise.planning.sources.resolve import resolve_source
    from gpuwise.recommend.request import Traffic
    from gpuwise.recommend.serve import serve

    r = serve(resolve_source("gpt2-xl", None), Traffic(concurrency=8), catalog=_catalog("h100-sxm", "apple-ane-m4"))
    # 25 heads split over no power of two: more than one GPU a replica only as pipeline stages
    assert {dict(o.parallel)["tp"] for o in r.rows if o.gpu == "h100-sxm"} == {1}
    assert all(dict(o.parallel)["pp"] == o.count for o in r.rows if o.gpu == "h100-sxm")
    (ane,) = [o for o in r.excluded if o.gpu == "apple-ane-m4"]
    assert "int8 graphs only" in ane.excluded
    for o in r.rows:
        assert o.per_gpu == pytest.approx(o.throughput / (o.count * o.replicas))


@pytest.mark.parametrize("width", [60, 80, 200])
@pytest.mark.parametrize("mode", [[], ["--serve"]])
def test_no_width_splits_a_gpu_name_or_cuts_a_figure(capsys, monkeypatch, mode, width):
    """Issue 27: at 60, 80 (a pipe) and 200 columns the table drops columns rather than fold a name or cut a
    figure: every ranked row starts with its whole catalog key."""
    monkeypatch.setenv("COLUMNS", str(width))
    workload = [] if mode else ["--seq", "128", "--batch", "8", "--tokens", "1e8"]
    gpus = ("rtx-4060-ti-16gb", "a100-80gb-sxm", "h100-sxm")
    code, out, err = run_cli(capsys, "recommend", "--model", "gpt2", *workload, *mode, "--gpu", ",".join(gpus),
                             "--max-gpus", "2")
    assert code == 0, err
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= width
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s*\*?\s+[a-z0-9]+-", line)]
    assert rows and all(any(word in gpus for word in row[:2]) for row in rows), out
    if width < 80:
        assert "hidden at" in out  # the columns left out are named


def test_counts_the_global_batch_does_not_split_over_are_named_not_dropped_silently(capsys):
    code, out, err = run_cli(capsys, "recommend", "--model", "gpt2", "--seq", "64", "--batch", "12", "--tokens",
                             "1e7", "--gpu", "h100-sxm")
    assert code == 0, err
    assert "not tried: 8 GPUs, which --batch 12 does not split over evenly (--batch 16 does)." in " ".join(out.split())
    code, out, err = run_cli(capsys, "recommend", "--model", "gpt2", "--seq", "64", "--batch", "12", "--tokens",
                             "1e7", "--gpu", "h100-sxm", "--json")
    data = json.loads(out)
    assert data["uneven_counts"] == [8]
    assert sorted(r["count"] for r in data["rows"] if r["fits"]) == [1, 2, 4]


def test_a_ranking_with_nothing_in_it_says_so_and_exits_1(capsys):
    """Issue 30: an empty recommend table exited 0 with no line. Training Llama 2 7B on one 12 GB RTX 3060 does not
    fit even at micro-batch 1 with checkpointing: the left-out table gives the reason, one line on stderr says so,
    exit 1."""
    code, out, err = run_cli(capsys, "recommend", "--model", "llama2-7b", "--gpu", "rtx-3060-12gb", "--max-gpus", "1")
    assert code == 1, err
    assert "left out" in out and err.strip().endswith("no option fits: 1 GPU option(s) left out, each with its "
                                                      "reason above")
