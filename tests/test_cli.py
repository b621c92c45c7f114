"""The command line: named errors with non-zero exits instead of tracebacks, plain lines when not on a
terminal, the checkpoint actually used named in the output."""
import shutil

import pytest
from helpers import ROOT, TINY_LM, cli_args

from jaxformer.cli import main as cli_main

TRAIN = ["train.steps=4", "train.log_every=2", "train.eval_every=4", "train.checkpoint_every=4"]


@pytest.mark.parametrize("name, text, message", [
    ("cfg.txt", "def get_config(): ...", "is not a Python file"),
    ("wrong_type.py", "def get_config():\n    return {'model': {}}\n", "returned dict, not a jaxformer.config.Config"),
    ("none.py", "x = 1\n", "defines no get_config()"),
    ("broken.py", "def get_config(:\n", "failed: SyntaxError"),
    ("raises.py", "def get_config():\n    return undefined_name\n", "failed: NameError"),
    ("invalid.py", "from jaxformer.config import ModelConfig\ndef get_config():\n    return ModelConfig(d_model=30)\n",
     "model.d_model=30 is not a multiple of model.num_heads=8"),
])
def test_bad_config_files_are_named_errors(tmp_path, name, text, message, capsys):
    path = tmp_path / name
    path.write_text(text)
    assert cli_main(["train", str(path), "--workdir", str(tmp_path / "run")]) == 2
    out = capsys.readouterr().out.replace("\n", " ")
    assert "config error" in out and message in out and "Traceback" not in out
    assert not (tmp_path / "run").exists()
    assert cli_main(["params", str(path)]) == 2


@pytest.mark.slow          # default-lane budget
def test_train_off_a_terminal_prints_lines_and_eval_names_the_checkpoint_it_used(tmp_path, capfd):
    assert cli_main(["train", *cli_args("configs/alice.py", TINY_LM + TRAIN), "--workdir", str(tmp_path)]) == 0
    out, err = capfd.readouterr()
    assert "\r" not in out + err                                  # no progress-bar frames in a log file
    lines = [x for x in out.splitlines() if x.startswith("train step")]
    assert [x.split()[2] for x in lines] == ["2/4", "4/4"], lines
    assert "eval step 4/4" in out and "status: completed at step 4" in out

    assert cli_main(["eval", "--workdir", str(tmp_path)]) == 0
    assert "held-out (best checkpoint, step 4)" in capfd.readouterr().out
    shutil.rmtree(tmp_path / "checkpoints" / "best")
    assert cli_main(["eval", "--workdir", str(tmp_path)]) == 0
    out, err = capfd.readouterr()
    assert "held-out (latest checkpoint, step 4)" in out and "no readable best checkpoint" in out + err
    assert cli_main(["generate", "--workdir", str(tmp_path), "--prompt", "Alice", "--max-new", "3"]) == 0
    assert "latest checkpoint (step 4)" in capfd.readouterr().out
    assert not (tmp_path / "checkpoints" / "best").exists()       # reading never creates folders


def test_params_runs_on_the_builtin_corpus(capsys):
    assert cli_main(["params", *cli_args("configs/alice.py", [])]) == 0
    assert "finite=True" in capsys.readouterr().out


def test_plan_shows_the_sharding_of_every_parameter_without_compiling(capsys):
    import jax
    n, platform = jax.device_count(), jax.devices()[0].platform
    assert cli_main(["plan", str(ROOT / "configs/parallel/fsdp.py")]) == 0
    out = capsys.readouterr().out
    assert f"mesh: stage 1 × data 1 × fsdp {n} × context 1 × expert 1 × tensor 1 (jit) on {n} {platform} device(s)" in out
    assert "| embed | fsdp |" in out and "encoder/layers/blocks/ffn/w1" in out
    if n % 2:                                                           # tensor=2 needs an even device count
        assert cli_main(["plan", str(ROOT / "configs/parallel/tensor.py")]) == 2
        assert f"config error: parallel: {n} devices cannot be split" in capsys.readouterr().out
