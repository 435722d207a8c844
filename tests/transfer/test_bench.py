"""``asyncconn bench transfer`` runs end to end on the CPU with tiny sizes and reports every CPU figure."""

from __future__ import annotations

import json

import pytest
import torch

from asyncconn.cli.main import main


def test_bench_transfer_json_reports_cpu_figures(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "transfer", "--json", "--loads", "20", "--saves", "64", "--save-batch", "16"]
    prefix = ["--prefix-values", "6", "--prefix-value-size", "8KiB"]
    code = main(
        [
            *argv,
            "--repeat",
            "1",
            "--put-latency",
            "5ms",
            "--load-size",
            "4KiB",
            "--save-size",
            "4KiB",
            *prefix,
        ]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    loader, saver = result["loader_cpu"], result["saver_cpu"]
    assert loader["loads"] == 20 and loader["value_bytes"] == 4096
    for key in ("loader_loads_per_s", "gather_loads_per_s", "submit_p99_us", "poll_us_per_result_p50"):
        assert loader[key] > 0
    prefix = result["prefix_cpu"]
    assert prefix["values"] == 6 and prefix["value_bytes"] == 8192
    assert prefix["grouped_ms"] > 0 and prefix["one_read_per_value_ms"] > 0
    assert saver["copy_thread"] and not result["saver_cpu_sync"]["copy_thread"]  # both modes, one run
    for saver in (result["saver_cpu"], result["saver_cpu_sync"]):
        assert saver["saves"] == 64 and saver["put_latency_ms"] == 5.0
        for key in ("submit_p50_us", "submit_p99_us", "flush_p99_us", "tracker_saves_per_s_no_latency"):
            assert saver[key] > 0
        assert saver["request_reported_after_ms_p50"] >= 5.0  # not reported before the store answers
    if not result["machine"]["cuda"]:
        assert result["gpu"].startswith("not run")


def test_bench_transfer_human_output(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "transfer", "--loads", "5", "--saves", "8", "--save-batch", "4", "--repeat", "1"]
    argv += ["--prefix-values", "4", "--prefix-value-size", "4KiB"]
    assert main([*argv, "--put-latency", "1ms", "--load-size", "1KiB", "--save-size", "1KiB"]) == 0
    out = capsys.readouterr().out
    assert (
        "loader_cpu:" in out
        and "prefix_cpu:" in out
        and "saver_cpu:" in out
        and "saver_cpu_sync:" in out
        and "submit_p99_us" in out
    )


@pytest.mark.parametrize("bad", [["--repeat", "0"], ["--loads", "-3"], ["--save-size", "lots"]])
def test_bad_arguments_are_usage_errors(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "transfer", *bad]) == 2
    assert bad[0] in capsys.readouterr().err


def test_bench_gpu_without_allow_cpu_measures_only_on_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    small = ["--kv-values", "1", "--kv-layers", "1", "--kv-blocks-per-value", "1", "--ec-rows", "8"]
    small += ["--scatter-values", "2", "--scatter-layers", "2"]
    assert main(["bench", "gpu", "--json", "--repeat", "2", "--ec-width", "64", *small]) == 0
    out = json.loads(capsys.readouterr().out)
    cuda = torch.cuda.is_available()
    assert out["machine"]["cuda"] is cuda
    for part in ("kv_load", "kv_save", "kv_scatter", "ec_install"):
        assert isinstance(out[part], dict) if cuda else out[part] == "not measured: no CUDA device"


def test_bench_gpu_runs_its_code_on_the_cpu_device(capsys: pytest.CaptureFixture[str]) -> None:
    small = ["--kv-values", "2", "--kv-layers", "2", "--kv-blocks-per-value", "2", "--ec-rows", "8"]
    small += ["--scatter-values", "3,5", "--scatter-layers", "2"]
    where = [] if torch.cuda.is_available() else ["--allow-cpu"]
    assert main(["bench", "gpu", "--json", "--repeat", "2", "--ec-width", "64", *small, *where]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_load"]["bytes"] == out["kv_save"]["bytes"] == 2 * 2 * 2 * 2 * 16 * 8 * 128 * 2
    assert out["kv_load"]["worker_vs_raw"] > 0 and out["kv_save"]["snapshot_vs_raw"] > 0
    assert out["ec_install"]["items"] == 2 and out["ec_install"]["host_p50_us"] > 0
    rows = out["kv_scatter"]["rows"]
    assert [r["values"] for r in rows] == [3, 5] and out["kv_scatter"]["layers"] == 2
    assert all(r["per_value_host_us"] > 0 and r["batched_host_us"] > 0 for r in rows)
