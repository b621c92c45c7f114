"""Scale-out: every parallel strategy against one device, shardings against the rules, FSDP memory, refused
meshes, checkpoints restored onto other meshes, sharded decoding, and a real 2-process run.

Eight fake CPU devices need their own process (the device count is fixed when JAX starts): the module fixture
runs tests/parallel_worker.py once, and the tests assert on what it recorded. The 2-process tests start two
`jaxformer train` processes of 4 devices each, connected through a coordinator on 127.0.0.1.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import ROOT, TINY_REVERSE, cli_args, train_losses
from jaxformer import distributed
from jaxformer.config import ConfigError, ParallelConfig
from jaxformer.parallel import RULES, rules_table

# float32 tolerance for 5 optimizer steps computed in another reduction order: 2^7 ulps of headroom over the
# worst difference seen (~3e-7 relative, i.e. a couple of ulps)
RTOL = 2 ** 7 * float(np.finfo(np.float32).eps)
# heads and vocab that split 4 ways; a constant, large learning rate, so that 5 steps move the losses and 20
# give a model whose decoded tokens vary (a near-initial model decodes one token everywhere)
SMALL = ["model.num_heads=4", "model.vocab_size=16", "model.runtime.dropout=0.0", "optim.schedule=constant",
         "optim.lr=0.01", "optim.warmup_steps=0"]
STRATEGIES = {
    "data parallel": ["parallel.data=8"],
    "fsdp": ["parallel.data=1", "parallel.fsdp=8"],
    "data x tensor": ["parallel.data=2", "parallel.tensor=4"],
    "data x fsdp x tensor": ["parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2"],
    "shard_map": ["parallel.mode=shard_map", "parallel.data=8"],
    "context": ["parallel.data=1", "parallel.context=8"],
    "data x context": ["parallel.data=2", "parallel.context=4"],
}
# a MoE reversal model whose 8 experts split over the expert axis (top-2, capacity that drops some tokens)
MOE = SMALL + ["model.ffn=moe", "model.moe.num_experts=8", "model.moe.top_k=2", "model.runtime.moe_capacity_factor=1.0"]
MOE_MESHES = {"one device": ["parallel.data=1"], "expert 8": ["parallel.data=1", "parallel.expert=8"]}
# low-rank adapters on every projection of the reversal model, the frozen base in float32 and in int8
LORA = SMALL + ["model.lora.rank=4", "model.lora.targets=q,k,v,o,up,down"]
LORA_MESHES = {"one device": ["parallel.data=1"], "fsdp": STRATEGIES["fsdp"],
               "data x fsdp x tensor": STRATEGIES["data x fsdp x tensor"],
               "int8 one device": ["parallel.data=1", "model.lora.base=int8"],
               "int8 data x fsdp x tensor": STRATEGIES["data x fsdp x tensor"] + ["model.lora.base=int8"]}
# capture, patch, the patching grid and attribution under each plan (a tiny char LM, heads that split 2 ways)
INTERP = {"one": ["parallel.data=1", "model.num_heads=4"],
          "data x fsdp x tensor": ["parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2", "model.num_heads=4"],
          "fsdp": ["parallel.data=1", "parallel.fsdp=8", "model.num_heads=4"],
          "data x tensor": ["parallel.data=2", "parallel.tensor=4", "model.num_heads=4"]}
REFUSED = {
    "sizes that do not multiply to 8": (["parallel.data=3"], "needs 3 devices; 8 are available"),
    "a rule naming an unknown mesh axis": (["parallel.rules=mlp:pipeline"], "unknown mesh axis 'pipeline'"),
    "kv heads not divisible by tensor": (["parallel.data=1", "parallel.tensor=8"], "not divisible by mesh axes"),
    "batch not divisible by data": (["parallel.data=8", "data.batch_size=12"], "data.batch_size=12"),
}


def _worker(job: dict, tmp) -> dict:
    (tmp / "job.json").write_text(json.dumps(job))
    proc = subprocess.run([sys.executable, str(ROOT / "tests/parallel_worker.py"), str(tmp / "job.json"),
                           str(tmp / "out.json")], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads((tmp / "out.json").read_text())


# The default lane's worker covers the 3-axis mesh (data x fsdp x tensor: a batch split over data and fsdp,
# parameters over fsdp and tensor) against one device, the refused meshes and the shipped configs; the slow lane's
# second worker (~80 s) adds the other strategies (data parallel and FSDP alone among them), the expert axis,
# checkpoints resharded across meshes and sharded decoding.
DEFAULT_STRATEGIES = ("data x fsdp x tensor", "data x context")


def _strategy(name):
    return name if name in DEFAULT_STRATEGIES else pytest.param(name, marks=pytest.mark.slow)


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eight")
    return _worker({
        "devices": 8, "tmp": str(tmp), "baseline": SMALL + ["parallel.data=1"],
        "strategies": {k: SMALL + STRATEGIES[k] for k in DEFAULT_STRATEGIES},
        "errors": {k: v[0] for k, v in REFUSED.items()},
        "configs": [str(p) for p in sorted((ROOT / "configs/parallel").glob("*.py"))],
        "interp": {"one": INTERP["one"], "data x fsdp x tensor": INTERP["data x fsdp x tensor"]},
    }, tmp)


@pytest.fixture(scope="module")
def eight_more(tmp_path_factory):
    """The slow lane's 8-device worker: the remaining strategies (with their own one-device baseline, and FSDP
    again for the resume comparison), MoE on the expert axis, checkpoints resharded across meshes, and sharded
    decoding."""
    tmp = tmp_path_factory.mktemp("eight-more")
    steps = ["train.steps=20", "train.eval_every=20", "train.checkpoint_every=10", "train.log_every=1"]
    return _worker({
        "devices": 8, "tmp": str(tmp), "baseline": SMALL + ["parallel.data=1"],
        "strategies": {k: SMALL + v for k, v in STRATEGIES.items() if k not in DEFAULT_STRATEGIES},
        "reshard": {"overrides": SMALL + STRATEGIES["fsdp"] + steps, "workdir": str(tmp / "fsdp-run"),
                    "meshes": {"fsdp": SMALL + STRATEGIES["fsdp"],
                               "data x tensor": SMALL + STRATEGIES["data x tensor"],
                               "one": SMALL + ["parallel.data=1"]}},
        "moe": {k: MOE + v for k, v in MOE_MESHES.items()},
        "lora": {k: LORA + v for k, v in LORA_MESHES.items()},
        "eval_tasks": {"train": ["train.steps=4", "train.eval_every=4", "train.checkpoint_every=4",
                                 "model.num_heads=4"], "workdir": str(tmp / "lm-run"),
                       "meshes": {"one": ["parallel.data=1"], "data x tensor": ["parallel.data=2", "parallel.tensor=4"],
                                  "fsdp": ["parallel.data=1", "parallel.fsdp=8"]}},
        "interp": {k: v for k, v in INTERP.items() if k not in ("data x fsdp x tensor",)},
        "lm_decode": {"one": ["parallel.data=1", "model.num_heads=4"],
                      "data x tensor": ["parallel.data=2", "parallel.tensor=4", "model.num_heads=4"]},
    }, tmp)


def _run(request, name) -> dict:
    """The strategy's record, from whichever worker ran it."""
    return request.getfixturevalue("eight" if name in DEFAULT_STRATEGIES else "eight_more")["strategies"]


@pytest.mark.parametrize("name", [_strategy(n) for n in STRATEGIES])
def test_every_strategy_trains_like_one_device(request, name):
    runs = _run(request, name)
    base, got = runs["one device"]["losses"], runs[name]["losses"]
    assert len(got) == len(base) == 5
    np.testing.assert_allclose(got, base, rtol=RTOL)
    assert base[0] != base[-1]                                  # the steps did change the model


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp", "data x fsdp x tensor", "int8 data x fsdp x tensor"])
def test_adapters_train_under_every_plan_like_one_device(eight_more, name):
    runs = eight_more["lora"]
    base = runs["int8 one device" if name.startswith("int8") else "one device"]["losses"]
    np.testing.assert_allclose(runs[name]["losses"], base, rtol=RTOL)
    assert base[0] != base[-1]
    specs = runs[name]["specs"]
    a = [s for p, s in specs.items() if p.startswith("['model']") and p.endswith("['wq']['a'].value")]
    assert a and all(s[1] is not None for s in a), a          # A [L, D, r]: D over the fsdp axis like wq's D


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in MOE_MESHES if n != "one device"])
def test_experts_sharded_over_the_expert_axis_train_like_one_device(eight_more, name):
    eight = eight_more
    r, base = eight["moe"][name], eight["moe"]["one device"]["losses"]
    np.testing.assert_allclose(r["losses"], base, rtol=RTOL)
    assert base[0] != base[-1]
    w1 = [s for p, s in r["specs"].items() if p.startswith("['model']") and p.endswith("['ffn']['w1'].value")]
    assert w1 and all(s[1] == "expert" for s in w1), w1                 # [L, E, D, F]: E over the expert axis
    assert r["logical"][next(p for p in r["logical"] if p.endswith("['ffn']['w1'].value"))][1] == "expert"
    # the train step's router metrics: per-expert load sums to 1, some tokens dropped at capacity factor 1, the
    # balancing loss ≥ 1 (1 = uniform); sharded, the same values as on one device
    one = eight["moe"]["one device"]["moe"]
    for m in (one, r["moe"]):
        assert all(abs(sum(load) - 1) < 1e-5 for load in m["moe_load"])
        assert all(0 <= d < 1 for d in m["moe_dropped"]) and max(m["moe_dropped"]) > 0
        assert all(b >= 1 - 1e-5 for b in m["moe_balance"])
    for k in ("moe_dropped", "moe_balance", "moe_z"):
        np.testing.assert_allclose(r["moe"][k], one[k], rtol=RTOL, atol=1e-6)


def _expected_spec(names, sizes, shape):
    """PartitionSpec (as a list) that the rule table gives logical `names` on a mesh of `sizes`."""
    out, used = [], set()
    for name, dim in zip(names, shape):
        axes = [a for a in (RULES[name] if name else ()) if sizes[a] > 1 and a not in used]
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return out


@pytest.mark.parametrize("name", [_strategy(n) for n in STRATEGIES if n != "shard_map"])
def test_parameter_and_optimizer_shardings_follow_the_rules(request, name):
    r = _run(request, name)[name]
    sized = {p: b["total"] for p, b in r["array_bytes"].items()}
    checked = 0
    for path, spec in r["specs"].items():
        names = r["logical"].get(path)
        if names is None:                                        # step counters, the sinusoidal table
            assert all(s is None for s in spec), (path, spec)
            continue
        assert spec == _expected_spec(names, r["mesh"], [None] * len(names)), (path, names, spec)
        checked += 1
    assert checked > 50 and sized
    # the optimizer's moments are sharded exactly like their parameters
    mu = {p.split("['mu']")[1]: s for p, s in r["specs"].items() if "['mu']" in p}
    params = {p.removeprefix("['model']"): s for p, s in r["specs"].items() if p.startswith("['model']")}
    assert mu and all(params[k] == s for k, s in mu.items())


def test_shardings_of_data_x_fsdp_x_tensor_spelled_out(eight):
    specs = eight["strategies"]["data x fsdp x tensor"]["specs"]
    get = lambda suffix: next(s for p, s in specs.items() if p.endswith(suffix) and p.startswith("['model']"))
    assert get("['self_attn']['wq'].value") == [None, "fsdp", "tensor", None]      # [L, D, N, H]
    assert get("['ffn']['w2'].value") == [None, "tensor", "fsdp"]                  # [L, F, D]
    assert get("['embed']['tokens'].value") == ["tensor", "fsdp"]                  # [V, D]
    assert all(s is None for s in get("['embed']['table'].value"))


@pytest.mark.slow
def test_shard_map_mode_keeps_the_state_replicated(eight_more):
    r = eight_more["strategies"]["shard_map"]
    assert all(all(s is None for s in spec) for spec in r["specs"].values())
    assert r["bytes"]["model"]["per_device_max"] == r["bytes"]["model"]["total"]


@pytest.mark.slow
def test_fsdp_holds_an_eighth_of_each_sharded_array_per_device(eight, eight_more):
    r = eight_more["strategies"]["fsdp"]
    replicated_extra = 0
    for path, b in r["array_bytes"].items():
        if "embed" in (r["logical"].get(path) or []):
            assert b["per_device_max"] * 8 == b["total"], path
        else:
            replicated_extra += b["total"]                       # biases of heads/mlp, counters, the PE table
    for part in ("model", "opt"):
        total, per_device = r["bytes"][part]["total"], r["bytes"][part]["per_device_max"]
        assert per_device < total / 4
    dp = eight_more["strategies"]["data parallel"]["bytes"]["model"]
    assert dp["per_device_max"] == dp["total"]                   # data parallel replicates
    assert r["bytes"]["model"]["per_device_max"] <= r["bytes"]["model"]["total"] / 8 + replicated_extra


def test_shipped_parallel_configs_plan_eight_devices(eight):
    mesh = lambda stage=1, data=1, fsdp=1, context=1, expert=1, tensor=1: {        # noqa: E731
        "stage": stage, "data": data, "fsdp": fsdp, "context": context, "expert": expert, "tensor": tensor}
    assert eight["configs"] == {
        "data": {"mesh": mesh(data=8), "mode": "jit"},
        "expert": {"mesh": mesh(data=2, expert=4), "mode": "jit"},
        "fsdp": {"mesh": mesh(fsdp=8), "mode": "jit"},
        "tensor": {"mesh": mesh(data=4, tensor=2), "mode": "jit"},
        "hybrid": {"mesh": mesh(data=2, fsdp=2, tensor=2), "mode": "jit"},
        "context": {"mesh": mesh(data=2, context=4), "mode": "jit"},
        "pipeline": {"mesh": mesh(stage=2, data=4), "mode": "jit"},
        "shard_map": {"mesh": mesh(data=8), "mode": "shard_map"}}


@pytest.mark.parametrize("name", list(REFUSED))
def test_bad_meshes_are_refused_by_name_before_compiling(eight, name):
    r = eight["errors"][name]
    assert r["error"] == "ConfigError", r
    assert REFUSED[name][1] in r["message"]
    assert r["compiled"] == 0


@pytest.mark.slow
def test_resume_on_a_mesh_is_bitwise(eight_more):
    """Stopped at step 2 and resumed (train()) vs 5 uninterrupted steps of the same FSDP plan: equal bits."""
    r = eight_more["reshard"]
    assert sorted(map(int, r["losses"])) == list(range(1, 21))
    assert [r["losses"][str(s)] for s in range(1, 6)] == eight_more["strategies"]["fsdp"]["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["data x tensor", "one"])
def test_checkpoint_saved_under_fsdp_restores_onto_another_mesh(eight_more, mesh):
    r = eight_more["reshard"]
    assert r[mesh]["values"] == r["fsdp"]["values"]                 # every parameter, bitwise
    if mesh == "data x tensor":
        assert r[mesh]["specs"] != r["fsdp"]["specs"]                # and it really was resharded


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["data x tensor", "fsdp"])
def test_sharded_decoding_gives_the_tokens_of_one_device(eight_more, mesh):
    r = eight_more["reshard"]
    for how in ("greedy", "beam"):
        assert r[mesh][how] == r["one"][how], how
        assert len({tuple(row) for row in r["one"][how]}) > 1, how         # the inputs get different answers


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["data x tensor", "fsdp"])
def test_eval_tasks_scores_a_sharded_model_as_one_device(eight_more, mesh):
    r = eight_more["eval_tasks"]
    ours, one = r[mesh], r["one"]
    np.testing.assert_allclose([x[0] for x in ours["loglikelihood"]], [x[0] for x in one["loglikelihood"]],
                               rtol=RTOL)
    assert ours["generated"] == one["generated"]


@pytest.mark.slow
def test_sharded_lm_decoding_gives_the_tokens_of_one_device(eight_more):
    r = eight_more["lm_decode"]
    assert r["data x tensor"] == r["one"]
    assert len({t for row in r["one"]["sampled"] for t in row}) > 3            # sampling really varies


@pytest.mark.parametrize("mesh", ["data x fsdp x tensor", pytest.param("fsdp", marks=pytest.mark.slow),
                                  pytest.param("data x tensor", marks=pytest.mark.slow)])
def test_capture_patch_and_the_patching_grid_under_a_plan_equal_one_device(request, mesh):
    """Captured sites (with a steering patch applied), the patched logits, the patching grid and the attribution
    map under each parallel plan equal one device's, and the captured values are split over the batch like the
    activations they are (the batch axis of [L,B,...] over the plan's data axes)."""
    r = request.getfixturevalue("eight" if mesh == "data x fsdp x tensor" else "eight_more")["interp"]
    one = request.getfixturevalue("eight")["interp"]["one"]
    ours = r[mesh]
    for key in ("logits", "resid_post", "z", "grid", "attribution"):
        np.testing.assert_allclose(np.asarray(ours[key]), np.asarray(one[key]), rtol=1e-4, atol=1e-5, err_msg=key)
    assert np.abs(np.asarray(one["grid"])).max() > 0.1                     # the corruption matters somewhere
    batch_axes = [a for a in ("data", "fsdp") if ours["mesh"].get(a, 1) > 1]
    for site in ("resid_post", "z"):
        spec = ours["specs"][site] + [None] * 5
        split = spec[1] if isinstance(spec[1], list) else [spec[1]]
        assert set(batch_axes) <= set(split), (site, spec)


# ----------------------------------------------------------------------------- two processes

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(workdir, overrides, n=2):
    """Start n `jaxformer train` processes of 4 devices each. Their output goes to files (an unread pipe can
    block a process, and with it the collective its peers wait in); Python's fault handler prints every
    thread's stack should the distributed runtime abort one."""
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONFAULTHANDLER="1",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4")
    procs = []
    Path(workdir).parent.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        args = cli_args("configs/reverse.py", TINY_REVERSE + SMALL + overrides + [
            f"parallel.coordinator=127.0.0.1:{port}", f"parallel.num_processes={n}", f"parallel.process_id={i}"])
        out = open(Path(workdir).parent / f"{Path(workdir).name}-{port}-{i}.out", "w+")
        err = open(Path(workdir).parent / f"{Path(workdir).name}-{port}-{i}.err", "w+")
        p = subprocess.Popen([sys.executable, "-m", "jaxformer.cli", "train", *args, "--workdir", str(workdir),
                              "--no-progress"], env=env, stdout=out, stderr=err, text=True)
        p.files = (out, err)
        procs.append(p)
    return procs


def _wait(procs, timeout=600) -> list[tuple[str, str]]:
    """Wait for every process; -> (stdout, stderr) of each."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    outs = []
    for p in procs:
        for f in p.files:
            f.seek(0)
        outs.append(tuple(f.read() for f in p.files))
        for f in p.files:
            f.close()
    return outs


def _tails(outs) -> str:
    return "\n".join(f"--- process {i} stderr:\n{err[-3000:]}" for i, (_, err) in enumerate(outs))


@pytest.mark.slow          # two 4-device processes against one: ~55 s on 2 cores (make test-all)
def test_two_processes_train_like_one_process_and_one_device(eight_more, tmp_path):
    procs = _launch(tmp_path / "run", ["train.steps=5", "train.log_every=1", "train.eval_every=5"])
    outs = _wait(procs)
    assert [p.returncode for p in procs] == [0, 0], _tails(outs)
    assert "process 0 of 2, 4 local devices of 8" in outs[0][1]
    assert "status: completed" in outs[0][0] and "status: completed" not in outs[1][0]   # process 0 reports
    losses = [train_losses(tmp_path / "run")[s] for s in range(1, 6)]
    np.testing.assert_allclose(losses, eight_more["strategies"]["data parallel"]["losses"], rtol=RTOL)
    np.testing.assert_allclose(losses, eight_more["strategies"]["one device"]["losses"], rtol=RTOL)
    # the same command with more steps resumes both processes from the checkpoint
    procs = _launch(tmp_path / "run", ["train.steps=7", "train.log_every=1", "train.eval_every=5"])
    outs = _wait(procs)
    assert [p.returncode for p in procs] == [0, 0], _tails(outs)
    assert "resuming at step 5" in outs[0][0]
    assert sorted(train_losses(tmp_path / "run")) == list(range(1, 8))


@pytest.mark.slow          # two processes (~12 s)
def test_two_processes_save_into_both_managers_at_once(tmp_path):
    """Every evaluation step is saved into "latest" and "best" at once. orbax names a save's cross-process
    barriers by the step alone, so without each manager's own barrier names the two managers' barriers met:
    one process failed ("barrier ... is already ongoing") or both waited for the barrier timeout."""
    port, steps = _free_port(), 4
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    files = [(open(tmp_path / f"{i}.out", "w+"), open(tmp_path / f"{i}.err", "w+")) for i in range(2)]
    procs = []
    for i, (out, err) in enumerate(files):
        procs.append(subprocess.Popen([sys.executable, str(Path(__file__).parent / "checkpoint_worker.py"), str(i),
                                       str(port), str(tmp_path / "checkpoints"), str(steps)],
                                      env=env, stdout=out, stderr=err, text=True))
        procs[-1].files = (out, err)
    outs = _wait(procs, timeout=120)        # ~10 s when the barriers are apart; a clash waits far longer
    assert [p.returncode for p in procs] == [0, 0], _tails(outs)
    for out, _ in outs:                     # (gloo prints its connections to stdout too)
        assert [ln for ln in out.splitlines() if not ln.startswith("[Gloo]")] == (
            [f"saved {s}" for s in range(1, steps + 1)] + ["restored"])


@pytest.mark.slow          # two processes and a heartbeat timeout: ~20 s of waiting (make test-all)
def test_a_dead_process_fails_the_other_within_the_heartbeat_timeout(tmp_path):
    workdir = tmp_path / "run"
    procs = _launch(workdir, ["train.steps=100000", "train.log_every=1", "parallel.heartbeat_timeout_s=5"])
    try:
        deadline = time.monotonic() + 300
        while not (workdir / "metrics.jsonl").exists() or not (workdir / "metrics.jsonl").read_text():
            assert time.monotonic() < deadline and procs[0].poll() is None, _tails(_wait(procs, 1))
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        procs[0].wait(timeout=120)
        waited = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        err = _wait(procs, 10)[0][1]
    assert procs[0].returncode != 0
    assert "another task died" in err                     # JAX's coordination service says why
    assert waited < 60


# ----------------------------------------------------------------------------- config, rules, launch settings

@pytest.mark.parametrize("kw, message", [
    ({"data": -1, "fsdp": -1}, "only one mesh axis size may be -1"),
    ({"data": 0}, "parallel.data=0"),
    ({"mode": "shard_map", "fsdp": 2}, "parallel.mode='shard_map'"),
    ({"rules": ("mlp",)}, "must look like 'logical:axis[+axis]'"),
    ({"rules": ("heads:tensor",)}, "unknown logical axis 'heads'"),
    ({"mode": "pmap"}, "parallel.mode='pmap'"),
    ({"num_processes": 2, "process_id": 2}, "parallel.process_id=2"),
])
def test_parallel_config_errors_name_the_field(kw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[").replace("+", r"\+")):
        ParallelConfig(**kw)


def test_the_scaling_guide_prints_the_rule_table():
    assert rules_table() in (ROOT / "docs" / "guide" / "scaling.md").read_text(encoding="utf-8")


def test_launch_settings_come_from_config_then_environment(monkeypatch):
    for v in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_NTASKS",
              "OMPI_COMM_WORLD_SIZE", "TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(v, raising=False)
    assert distributed.settings(ParallelConfig()) is None                       # one process: nothing to start
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    kw = distributed.settings(ParallelConfig())
    assert (kw["coordinator_address"], kw["num_processes"], kw["process_id"]) == ("10.0.0.1:1234", 4, 3)
    kw = distributed.settings(ParallelConfig(coordinator="h:1", num_processes=2, process_id=0))
    assert (kw["coordinator_address"], kw["num_processes"], kw["process_id"]) == ("h:1", 2, 0)
    assert distributed.settings(ParallelConfig(distributed="off")) is None
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(ConfigError, match="JAX_NUM_PROCESSES"):
        distributed.settings(ParallelConfig())
    for v in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(v)
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert distributed.settings(ParallelConfig()) is None
    detect = {"coordinator_address": None, "num_processes": None, "process_id": None,
              "heartbeat_timeout_seconds": 100, "initialization_timeout": 100}
    monkeypatch.setenv("SLURM_NTASKS", "2")                                      # srun: JAX detects the rest
    assert distributed.settings(ParallelConfig()) == detect
    monkeypatch.delenv("SLURM_NTASKS")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t1,t2")                          # a multi-host TPU slice
    assert distributed.settings(ParallelConfig()) == detect
