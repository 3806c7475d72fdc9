"""Measured pools (``jaxccl bench --tune``, :mod:`jaxccl.tune.measured`): real executor timings that the replay reads.

Small measurements on the emulated links: 4 of the 8 emulated devices for the library call, the command line on
rail:2x4 (the 8 devices of this process, so nothing restarts JAX), then the replay benchmark on its file.
"""

import json

import numpy as np
import pytest

from jaxccl.cli import main
from jaxccl.errors import JaxcclError, TuneError
from jaxccl.tune.measured import (
    MEASURED_SOURCE,
    MeasureConfig,
    measure_pools,
    parse_fabrics,
    read_measurement,
    save_pools,
)
from jaxccl.tune.replay import build_catalogs, calibrate_model, evaluate, load_pools, predict_pools

SIZES = (1 << 12, 1 << 14)


def test_small_measurement_is_a_pools_file_the_replay_evaluates(tmp_path):
    colls = ("all_gather", "all_reduce")  # AllReduce: two-part arms and int32 checks
    cfg = MeasureConfig(
        gpus_per_host=2, collectives=colls, sizes=SIZES, fabrics=("healthy", "fail2"), samples=11, warmup=0
    )
    pools = measure_pools(cfg, show_progress=False)
    path = tmp_path / "measured.npz"
    save_pools(pools, path)

    loaded = load_pools(path)  # the replay's reader, unchanged
    meta = read_measurement(path)
    assert meta["source"] == MEASURED_SOURCE and meta["config"]["samples"] == 11
    assert meta["checks"]["bitwise_vs_jax_lax"]["float32"] > 0 and meta["checks"]["bitwise_vs_jax_lax"]["int32"] > 0
    assert len(meta["load_average_per_fabric"]) == 3  # one per fabric, one at the end
    assert loaded.num_contexts == 2 * 2 * 2 and loaded.samples.shape[2] == 11
    assert {c["num_ranks"] for c in loaded.contexts} == {4}
    for i, c in enumerate(loaded.contexts):
        names = loaded.arm_names(i)
        assert names == [n for n in loaded.arms[c["collective"]] if n in names]
        assert len(names) == {"all_gather": 5, "reduce_scatter": 4, "all_reduce": 6}[c["collective"]]
        valid = np.isfinite(loaded.sim_s[i])
        assert (loaded.samples[i, valid] > 0).all() and np.isnan(loaded.samples[i, ~valid]).all()
    assert {c["split"] for c in loaded.contexts if c["nbytes"] == SIZES[0]} == {"train"}
    assert {c["split"] for c in loaded.contexts if c["nbytes"] == SIZES[1]} == {"test"}

    cats = build_catalogs(loaded)
    model, report = calibrate_model(loaded, catalogs=cats)
    assert report["calibrated_on"] == [f"{c}/2h/healthy" for c in colls]
    loaded.predictions = predict_pools(loaded, model, catalogs=cats, views=("actual",))
    test = loaded.indices("test")
    for policy in ("auto", "ucb1"):
        res = evaluate(loaded, policy, test, view="actual")
        assert res.realized.shape == (len(test),) and np.isfinite(res.realized).all()
        assert (res.selection >= -1e-9).all()  # never better than the best arm's steady mean


def test_command_line_records_pools_and_the_benchmark_replays_them(tmp_path, capsys):
    from benchmarks.tune import replay

    pools = tmp_path / "pools.npz"
    argv = ["bench", "--tune", "--topology", "rail:2x4", "-b", "4K", "-e", "8K", "-f", "2", "--samples", "11"]
    argv += ["-w", "0", "--collectives", "all_gather", "--fabrics", "healthy", "--quiet"]
    rc = main([*argv, "--json", str(pools)])
    out = capsys.readouterr().out
    assert rc == 0 and "bitwise equal to jax.lax: 10 (context, arm) checks" in out
    assert read_measurement(pools)["fabric"].startswith("rail 2 hosts x 4 GPUs")
    assert load_pools(pools).num_contexts == 2

    result = tmp_path / "replay.json"
    argv = ["--pools", "measured", str(pools), "--views", "actual", "--trials", "1", "--seeds", "1", "--json"]
    assert replay.main([*argv, str(result), "--tune-seeds", "1"]) == 0
    data = json.loads(result.read_text())
    assert data["benchmark"] == "tuning_replay_measured" and data["num_test"] == 1
    view = data["views"]["actual"]
    assert {"auto", "ucb1"} <= set(view["test"]) and "static" in view["transfer"]
    assert "oracle (best arm in hindsight)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fabrics", "healthy,fail9"], "unknown fabric(s) ['fail9']"),
        (["--samples", "0"], "--samples must be a positive integer"),
        (["--samples", "-3"], "--samples must be a positive integer"),
        (["--samples", "10"], "samples must be an integer above 10"),
        (["--collectives", "pmax"], "have no arm catalogue"),
        (["--topology", "ring:8"], "needs a one-segment rail preset"),
        (["--backend", "ppermute"], "does not take --backend"),
        (["-b", "4", "-e", "4"], "must be a positive multiple of 32 B"),
    ],
)
def test_bad_tune_input_is_one_named_error(tmp_path, capsys, args, message):
    path = tmp_path / "never.npz"
    assert main(["bench", "--tune", "--json", str(path), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxccl bench: error:") and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and not path.exists()


def test_tune_needs_json_and_config_errors_are_named():
    assert main(["bench", "--tune"]) == 2
    with pytest.raises(TuneError, match="unknown fabric"):
        parse_fabrics("healthy,bogus")
    with pytest.raises(TuneError, match="above 10"):
        MeasureConfig(samples=0)
    with pytest.raises(JaxcclError, match="unknown split"):
        MeasureConfig(split="random")
