"""The offload time model's check against a measured CPU decode, and its calibration."""

from __future__ import annotations

import json

import pytest
from test_sparse_decode import CharTokenizer

import minisparse.io.loading
from conftest import tiny_model
from minisparse.cli import main
from minisparse.engine.compose import step_bytes
from minisparse.offload import report as R
from minisparse.offload import time_model as T
from minisparse.offload.calibrate import calibrate, check_cpu_model, step_check
from minisparse.quant.apply import streamed_bytes

CPU = T.Processor("test cpu", bandwidth_gbs=40.0, call_us=100.0, measured=True)


def test_a_step_check_is_the_bytes_over_bandwidth_plus_the_calls():
    check = step_check("dense", 5e8, 60, 80.0, CPU)
    seconds = 5e8 / 40e9 + 60 * 100e-6  # 12.5 ms of bytes + 6 ms of calls
    assert check.modelled_tok_s == pytest.approx(1 / seconds)
    assert check.error == pytest.approx((1 / seconds) / 80.0 - 1)
    assert check.error < 0  # the model is slower than the measured 80 tok/s
    assert "error -" in check.line() and "measured   80.0" in check.line()


def test_calibration_reproduces_the_dense_step_and_keeps_the_bandwidth():
    dense = step_check("dense", 5e8, 60, 60.0, CPU)  # 16.7 ms: 12.5 ms of bytes + 4.2 ms
    cpu = calibrate(CPU, dense)
    assert cpu.bandwidth_gbs == CPU.bandwidth_gbs
    assert cpu.call_us == pytest.approx((1 / 60 - 5e8 / 40e9) / 60 * 1e6)
    assert dense.against(cpu).error == pytest.approx(0, abs=1e-12)
    assert "calibrated" in cpu.name
    sparse = step_check("sparse", 4e8, 60, 70.0, CPU).against(cpu)
    assert sparse.modelled_tok_s == pytest.approx(1 / (4e8 / 40e9 + 60 * cpu.call_us * 1e-6))


def test_a_step_faster_than_its_bytes_at_the_bandwidth_refits_the_bandwidth():
    dense = step_check("dense", 5e8, 60, 100.0, CPU)  # 10 ms < 12.5 ms of bytes at 40 GB/s
    cpu = calibrate(CPU, dense)
    assert cpu.call_us == 0.0 and cpu.bandwidth_gbs == pytest.approx(50.0)
    assert dense.against(cpu).error == pytest.approx(0, abs=1e-12)


def test_a_step_check_refuses_what_is_not_a_step():
    for tok_s, calls in ((0.0, 60), (float("nan"), 60), (80.0, 0)):
        with pytest.raises(ValueError, match="finite positive tok/s"):
            step_check("dense", 5e8, calls, tok_s, CPU)


def test_the_check_measures_dense_and_sparse_decode_of_the_same_model():
    model = tiny_model(seed=3, max_seq_len=512)
    dense, sparse = check_cpu_model(model, CharTokenizer(), 0.02, CPU, new_tokens=4, repeats=1)
    assert dense.step_bytes == streamed_bytes(model) == step_bytes(model)
    ffn = sum(streamed_bytes(layer.mlp) for layer in model.layers)
    # a thresholded MLP reads its gate and a share of up and down: between a third and all
    assert dense.step_bytes - 2 * ffn / 3 <= sparse.step_bytes < dense.step_bytes
    for check in (dense, sparse):
        assert check.measured_tok_s > 0 and check.calls == 2 * model.config.n_layers
        assert check.modelled_tok_s == pytest.approx(1 / CPU.seconds(check.step_bytes, check.calls))
    assert all(type(layer.mlp).__name__ == "MLP" for layer in model.layers)  # restored


def test_minisparse_offload_reports_the_check_of_its_cpu(monkeypatch, capsys):
    model = tiny_model(seed=5, max_seq_len=512)
    monkeypatch.setattr(minisparse.io.loading, "load", lambda *a, **k: (model, CharTokenizer()))
    monkeypatch.setattr(T, "measure_cpu", lambda: CPU)
    assert main(["offload", "--budget", "0.5", "--windows", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    dense, sparse = report["cpu_checks"]
    assert dense["calibrated_error"] == pytest.approx(0, abs=1e-9)
    assert sparse["step_bytes"] < dense["step_bytes"] and sparse["measured_tok_s"] > 0
    calls = dense["calls"]
    measured = step_check("d", dense["step_bytes"], calls, dense["measured_tok_s"], CPU)
    expected = calibrate(CPU, measured)
    assert report["cpu_measured"]["call_us"] == pytest.approx(expected.call_us)  # it is used
    again = step_check("s", sparse["step_bytes"], calls, sparse["measured_tok_s"], expected)
    assert sparse["calibrated_error"] == pytest.approx(again.error)
    text = R.format_report({**report, "machine": None})
    assert "checked on this CPU's decode" in text and "(calibrated)" in text
