"""``capture-proxy audit`` end to end with tiny random-weight models: a store holding the
model's own log probs and routing passes (exit 0) in every form, and each corruption a trainer
fears is caught (exit 1) and named: log probs one position off, routed-expert rows one position
off, a wrong id, an MoE capture audited with a dense model. Bad input is exit 2."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from capture_proxy.cli import main
from tests.audit.truthful import CHAIN, LONE, write_store

pytest.importorskip("torch", reason="the audit extra: scripts/install-audit")

NUM_GENERATED = sum(g for _, g in CHAIN + LONE)
NUM_ROWS = sum(p + g for p, g in CHAIN) - 1 + sum(p + g for p, g in LONE) - 1


@pytest.fixture(scope="module")
def stores(tiny_models, tmp_path_factory) -> dict[str, Path]:
    out = {}
    for corrupt in (None, "shift_log_probs", "shift_rows", "wrong_id"):
        path = tmp_path_factory.mktemp(f"store-{corrupt}")
        write_store(path, tiny_models["moe"], corrupt)
        out[corrupt or "truthful"] = path
    return out


def _audit(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["audit", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("form", ["npz", "arrow", "tree"])
def test_the_models_own_data_passes_in_every_form(tiny_models, stores, tmp_path, capsys, form):
    out_json, plot = tmp_path / "audit.json", tmp_path / "audit.png"
    code, out, _ = _audit(
        capsys,
        str(stores["truthful"]),
        "--model",
        str(tiny_models["moe"]),
        "--form",
        form,
        "--json",
        str(out_json),
        "--plot",
        str(plot),
    )
    assert code == 0, out
    assert out.splitlines()[-1] == "PASSED"
    doc = json.loads(out_json.read_text())
    assert doc["passed"] is True and doc["failures"] == []
    assert (doc["num_rollouts"], doc["num_samples"]) == (2, 2)
    lp = doc["log_probs"]
    assert (lp["num_tokens"], lp["num_compared"], lp["num_non_finite"]) == (NUM_GENERATED,) * 2 + (
        0,
    )
    assert lp["max_abs_delta"] < 1e-4 and lp["fraction_over"] == 0.0 and lp["k3_mean"] < 1e-8
    assert doc["alignment"]["0"] < 1e-4 < doc["alignment"]["1"]
    r = doc["routing"]
    assert (r["status"], r["num_rows"], r["agreement"], r["exact_fraction"]) == (
        "compared",
        NUM_ROWS,
        1.0,
        1.0,
    )
    assert r["per_layer"] == [1.0, 1.0] and r["shifted"]["1"] < 1.0
    assert doc["model"]["num_moe_layers"] == 2 and doc["model"]["top_k"] == 2
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {s["leaf_call_id"] for s in doc["samples"]} == {"chain-c2", "lone-c0"}


def test_log_probs_one_position_off_fail_and_the_shift_is_named(
    tiny_models, stores, tmp_path, capsys
):
    out_json = tmp_path / "a.json"
    code, out, _ = _audit(
        capsys,
        str(stores["shift_log_probs"]),
        "--model",
        str(tiny_models["moe"]),
        "--json",
        str(out_json),
    )
    assert code == 1
    doc = json.loads(out_json.read_text())
    assert "mean_abs_delta" in [f["check"] for f in doc["failures"]]
    a = doc["alignment"]
    assert a["1"] < 1e-4 < a["0"]  # the captured values fit the model one position later
    assert out.splitlines()[-1].startswith("FAILED: mean |delta|")


def test_routed_expert_rows_one_position_off_fail(tiny_models, stores, tmp_path, capsys):
    out_json = tmp_path / "a.json"
    code, _, _ = _audit(
        capsys,
        str(stores["shift_rows"]),
        "--model",
        str(tiny_models["moe"]),
        "--json",
        str(out_json),
    )
    assert code == 1
    doc = json.loads(out_json.read_text())
    assert [f["check"] for f in doc["failures"]] == ["expert_agreement"]
    assert doc["log_probs"]["max_abs_delta"] < 1e-4  # the log probs are right
    assert doc["routing"]["agreement"] < 0.9 and doc["routing"]["shifted"]["1"] == 1.0


def test_a_wrong_id_is_the_worst_position_with_its_token(tiny_models, stores, tmp_path, capsys):
    out_json = tmp_path / "a.json"
    code, out, _ = _audit(
        capsys, str(stores["wrong_id"]), "--model", str(tiny_models["moe"]), "--json", str(out_json)
    )
    assert code == 1
    doc = json.loads(out_json.read_text())
    worst = doc["worst"][0]
    position = sum(p + g for p, g in CHAIN[:2]) + CHAIN[2][0] + 2
    assert (worst["rollout_id"], worst["call_id"], worst["position"]) == (
        "chain",
        "chain-c2",
        position,
    )
    assert (
        worst["token_id"] == 151000
        and worst["token"] == "_TOKEN_151000_"
        or worst["token_id"] == 151000
    )
    assert abs(worst["delta"]) > 0.5
    assert f"chain-c2 @{position} id 151000 {worst['token']!r}" in out


def test_an_moe_capture_audited_with_a_dense_model_fails(tiny_models, stores, tmp_path, capsys):
    out_json = tmp_path / "a.json"
    code, out, _ = _audit(
        capsys,
        str(stores["truthful"]),
        "--model",
        str(tiny_models["dense"]),
        "--json",
        str(out_json),
    )
    assert code == 1
    doc = json.loads(out_json.read_text())
    checks = [f["check"] for f in doc["failures"]]
    assert checks[-1] == "routing" and doc["routing"]["status"] == "dense_model"
    assert "mean_abs_delta" in checks  # another model's log probs
    assert "model has no router" in out


def test_bad_input_is_exit_2_naming_it(tiny_models, stores, tmp_path, capsys):
    code, _, err = _audit(capsys, str(tmp_path / "nothing"), "--model", str(tiny_models["moe"]))
    assert code == 2 and "no store at" in err
    code, _, err = _audit(
        capsys, str(stores["truthful"]), "--model", str(tiny_models["moe"]), "--rollout", "nope"
    )
    assert (
        code == 2
        and err.strip() == f"capture-proxy audit: rollouts not in {stores['truthful']}: nope"
    )
    code, _, err = _audit(capsys, str(stores["truthful"]), "--model", str(tmp_path))
    assert code == 2 and "no config.json" in err


async def test_the_read_api_is_a_source_too(make_stack, tiny_models, stores, tmp_path):
    """The proxy serving the truthful store: the audit over its read API (a bearer token)
    passes; a wrong token and an unfrozen rollout in the arrow form are exit 2."""
    stack = await make_stack(store_dir=stores["truthful"], captures_token="t0k")
    base = str(stack.client.make_url("")).rstrip("/")
    model = ["--model", str(tiny_models["moe"])]
    out_json = tmp_path / "a.json"
    code = await asyncio.to_thread(
        main, ["audit", base, "--token", "t0k", *model, "--json", str(out_json)]
    )
    assert code == 0
    doc = json.loads(out_json.read_text())
    assert (doc["num_samples"], doc["routing"]["agreement"]) == (2, 1.0)
    assert await asyncio.to_thread(main, ["audit", base, "--token", "bad", *model]) == 2
    args = ["audit", base, "--token", "t0k", *model, "--form", "arrow", "--rollout", "chain"]
    assert await asyncio.to_thread(main, args) == 2  # not frozen: the export holds only frozen
