"""benchmarks/levers.py measures each kept speed lever against the program without it. These tests check that
its comparison is a real one: switching a lever off changes the lowered train step (a switch that patched
nothing, e.g. a renamed function the model no longer calls, would time one program twice and report "no
difference"), the A/A control changes nothing, and the verdict follows the paired interval.

Wrong implementations caught: a lever whose switch patches an attribute the model no longer reads (same text),
a switch that leaks past its program (the "after" text then equals "before"), a verdict read from the medians.
"""
import collections
import re
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import levers  # noqa: E402
import train_step  # noqa: E402


def _small(config: str) -> dict:
    c = {**train_step.CONFIGS[config], "B": 4, "T": 8, "D": 32, "N": 2, "F": 64, "Ld": 1}
    if c["arch"] == "encoder_decoder":
        c.update(S=8, Le=1)
    return c


def _lowered(name: str, which: str) -> tuple:
    """(lowered text, opcode counts of the compiled program): a lever that is a compiler option shows only in the
    latter (compiled texts themselves differ between two compilations of one program: names carry counters)."""
    lever = levers.LEVERS[name]
    step, state, batch, key = levers.build(_small(lever.configs[0]), lever, which)
    with lever.switch_off() if which == "before" else levers.contextlib.nullcontext():
        lowered = step.lower(state, batch, key)
        ops = collections.Counter(re.findall(r"= \S+ ([a-z-]+)\(", lowered.compile().as_text()))
        return lowered.as_text(), sorted(ops.items())


def _laid_out(name: str, which: str) -> str:
    """A decoding lever: the lowered cached step of a small decoder laid out for its first config's batch."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jaxformer.config import ModelConfig, replaced
    from jaxformer.nn import build_model
    lever = levers.LEVERS[name]
    batch = int(lever.configs[0].split()[1][1:])
    cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=11, d_model=16, num_heads=2, d_ff=40,
                   num_decoder_layers=1,
                      positional="rope", norm__position="pre", runtime__dropout=0.0, max_len=8)
    model = build_model(cfg)
    with lever.switch_off() if which == "before" else levers.contextlib.nullcontext():
        cache = model.init_cache(batch, 4)                   # the decoder laid out for decoding, in the cache
    graphdef, state = nnx.split(model)
    tok = jnp.ones((batch, 1), jnp.int32)
    return jax.jit(lambda s, c: nnx.merge(graphdef, s)(tok, tok, cache=c, mode="decode")[0]).lower(
        state, cache).as_text()


@pytest.mark.slow                      # compiles 14 small train steps (~30 s): benchmark tooling, not the library
@pytest.mark.parametrize("name", list(levers.LEVERS))
def test_switching_a_lever_off_changes_the_program_and_nothing_leaks(name, monkeypatch):
    from jaxformer.platforms import cpu as layout
    monkeypatch.setattr(layout, "TILED_MIN", 0)           # the small configs' [32,32] matrices are tiled too
    lowered = _laid_out if levers.LEVERS[name].decode else _lowered
    before, after = lowered(name, "before"), lowered(name, "after")
    assert (before == after) == (name == "control")       # "after" is built after "before": a leak shows


def test_the_verdict_follows_the_paired_interval():
    slow = [10.0, 12.0, 9.0, 11.0, 10.5, 12.5]                # the machine drifts by ±15% between pairs
    faster = [x * 0.95 for x in slow]
    r = levers.paired(slow, faster)
    assert r["ratio"] == pytest.approx(0.95) and r["verdict"] == "faster by more than 2%"
    r = levers.paired(slow, [x * 1.001 for x in slow])
    assert r["verdict"] == "no difference beyond ±2%"
    r = levers.paired(slow, [x * (1.05 if i % 2 else 0.95) for i, x in enumerate(slow)])
    assert r["verdict"] == "not resolved" and r["lo"] < 1 < r["hi"]


def test_merge_replaces_only_the_rerun_rows_and_never_mixes_machines():
    """`levers.py --merge`: a rerun's rows take the place of the old rows of the same lever and config, the other
    rows and their order stay, a new pair is appended, and both commands are recorded; a results file written on
    another machine (or with another margin or malloc setting) is refused with a named error."""
    row = lambda lever, config, ratio: {"lever": lever, "config": config, "ratio": ratio}       # noqa: E731
    head = {"machine": "m", "margin": 0.02, "glibc_tunables": "", "levers": {"a": {}, "b": {}}}
    old = {**head, "command": "python benchmarks/levers.py",
           "rows": [row("a", "tiny", 1.0), row("a", "base", 1.1), row("b", "base", 1.2)]}
    new = {**head, "command": "python benchmarks/levers.py --configs base --merge", "levers": {"c": {}},
           "rows": [row("a", "base", 0.9), row("c", "base", 0.8)]}
    m = levers.merged(old, new)
    assert [(r["lever"], r["config"], r["ratio"]) for r in m["rows"]] == [
        ("a", "tiny", 1.0), ("a", "base", 0.9), ("b", "base", 1.2), ("c", "base", 0.8)]
    assert levers.commands(m) == [old["command"], new["command"]]
    assert set(m["levers"]) == {"a", "b", "c"}
    assert levers.commands(levers.merged(m, new))[-2:] == [new["command"]] * 2
    for field, value in (("machine", "other"), ("margin", 0.05), ("glibc_tunables", "glibc.malloc.hugetlb=1")):
        with pytest.raises(levers.MergeError, match=field):
            levers.merged(old, {**new, field: value})


def test_train_step_ratio_is_paired_per_round_and_the_target_verdict_follows_its_interval():
    """benchmarks/train_step.py: ours/PyTorch from each round's two back-to-back processes. Wrong forms caught:
    unpaired (the rounds' drift would widen the interval past the target), a ratio inverted (torch/ours), an
    errored round that shifts the pairing, a verdict read from the point estimate."""
    drift = [1.0, 1.6, 0.7, 1.3, 0.9]                          # the machine's speed per round
    runs = {"jax": [{"s_per_step": 0.5 * d * (1 + 0.01 * i)} for i, d in enumerate(drift)],
            "torch": [{"s_per_step": d} for d in drift]}
    r = train_step.paired_ratio(runs)
    assert r["rounds"] == 5 and 1.9 < r["lo"] < r["ratio"] < r["hi"] < 2.05       # ours twice as fast
    assert train_step.target_verdict(r, 1.5) == "≥ 1.5×: met"
    assert train_step.target_verdict(r, 2.5) == "≥ 2.5×: missed"
    assert train_step.target_verdict(r, 1.98) == "≥ 1.98×: not resolved"
    assert train_step.target_verdict(None, 1.0) == "≥ 1×: not measured"
    runs["torch"][1] = {"error": "killed"}                      # that round is left out, the others stay paired
    r2 = train_step.paired_ratio(runs)
    assert r2["rounds"] == 4 and 1.9 < r2["lo"] and r2["hi"] < 2.05
    assert train_step.paired_ratio({"jax": runs["jax"][:1], "torch": runs["torch"][:1]}) is None


def test_decode_target_is_judged_on_each_rows_paired_interval():
    """benchmarks/decode.py: "ours at least as fast as PyTorch cached" is met only when every base row's paired
    interval lies at or above 1.0, missed when one lies wholly below, else not resolved. Wrong forms caught:
    a verdict from the point ratio alone (1.02 with an interval down to 0.9 would read "met")."""
    import decode

    def row(ratio, lo, hi):
        return {"size": "base", "batch": 1, "context": 64, "torch_cached_over_cached": ratio,
                "paired": {"ratio": ratio, "lo": lo, "hi": hi, "rounds": 7}}
    assert decode.torch_target([row(1.3, 1.1, 1.5)])[0] is True
    met, line = decode.torch_target([row(1.3, 1.1, 1.5), row(1.02, 0.9, 1.1)])
    assert met is None and "not resolved" in line and "straddling" in line
    met, line = decode.torch_target([row(1.02, 0.9, 1.1), row(0.8, 0.75, 0.85)])
    assert met is False and "not met" in line and "0.75, 0.85" in line
    ours, theirs = [2.0, 3.0, 1.0, 2.5], [4.0, 6.1, 2.0, 5.0]
    r = decode.paired_ratio(theirs, ours)                           # stats.paired_ratio, as decode.py calls it
    assert r["rounds"] == 4 and 1.95 < r["lo"] < r["ratio"] < r["hi"] < 2.1


def test_paired_times_alternate_their_order_every_round():
    import timing
    calls = []
    out = timing.paired_times_ms({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 4)
    assert calls[:2] == ["a", "b"]                                  # the warm-up calls
    assert calls[2:] == ["a", "b", "b", "a", "a", "b", "b", "a"]    # then rounds, order reversed every other one
    assert [len(v) for v in out.values()] == [4, 4]
