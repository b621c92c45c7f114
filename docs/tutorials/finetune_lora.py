# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# # Fine-tuning an imported model with LoRA, scored with eval-tasks
#
# A Hugging Face checkpoint comes in as an ordinary run (`jaxformer import-hf`), trains further with low-rank
# adapters around its frozen weights (`model.lora`), is scored on downstream tasks as lm-evaluation-harness
# scores them (`jaxformer eval-tasks`), and goes back out as a PEFT adapter that `peft` loads. Nothing is
# downloaded: the "pretrained" model is a small Llama that transformers builds here with random weights, and its
# tokenizer a byte-level BPE trained on the built-in Alice text. Every step is the CLI, called from Python.

# %% tags=["remove_input"]
# Setup, its source hidden on the site: progress bars and others' deprecation notices kept off the page. In a
# notebook kernel without ipywidgets, importing the training loop (which imports tqdm.auto for its progress bar,
# off here) warns "IProgress not found"; transformers draws a bar while it saves the Llama; peft calls a method
# transformers has deprecated.
import os
import warnings

os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"          # read when transformers is imported
warnings.filterwarnings("ignore", message="IProgress not found")
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")

# %%
import json
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from jaxformer.cli import main as jaxformer
from jaxformer.data.text import corpus_path
from jaxformer.inference import load_model

work = Path(tempfile.mkdtemp())
src = work / "llama"
src.mkdir()

tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator([corpus_path("builtin:alice").read_text(encoding="utf-8")],
                        trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"],
                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
tok.save(str(src / "tokenizer.json"))

torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
llama = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
llama.save_pretrained(src)
print(sorted(p.name for p in src.iterdir()))

# %% [markdown]
# ## Import: the same function, as a run at step 0
#
# `import-hf` writes a run directory whose step-0 checkpoint is the checkpoint's weights, evaluated on the
# built-in corpus tokenized with its tokenizer. Its logits are transformers' logits.

# %%
base = work / "base"
assert jaxformer(["import-hf", str(src), "--workdir", str(base), "--set", "data.block_size=64"]) == 0
ids = np.random.default_rng(0).integers(3, config.vocab_size, (2, 12))
with torch.no_grad():
    theirs = llama(torch.tensor(ids)).logits.numpy()
ours = np.asarray(load_model(base, "latest").model(jnp.asarray(ids))[0])
print("max |jaxformer - transformers| logits:", float(np.abs(ours - theirs).max()))
assert np.allclose(ours, theirs, atol=2e-4)

# %% [markdown]
# ## A task file, scored before fine-tuning
#
# Multiple choice as the harness defines it: each choice's summed log-likelihood after the context (`acc`), and
# per character (`acc_norm`), each with its standard error. The questions are lines of Alice the fine-tuning
# will read. The stand-in "pretrained" model knows nothing, so it scores chance; 150 rank-8 adapter steps on a
# CPU lower the held-out bits per byte a little (4.42 → 4.32 when this was written) and move these five
# questions hardly at all: the mechanics are the point here, and the standard errors say how little five
# questions can show.

# %%
QUESTIONS = [("Alice was beginning to get very", [" tired", " purple", " loud"], 0),
             ("and what is the use of a book,", [" thought Alice", " said the King", " cried the Owl"], 0),
             ("when suddenly a White", [" Rabbit", " Hatter", " Queen"], 0),
             ("Down, down,", [" down", " up", " away"], 0),
             ("she ran across the field after it, and fortunately was just in time to see it pop down a large",
              [" rabbit-hole", " teapot", " garden"], 0)]
tasks = work / "alice_mc.jsonl"
tasks.write_text("".join(json.dumps({"context": c, "choices": ch, "answer": a}) + "\n" for c, ch, a in QUESTIONS))


def scores(run):
    assert jaxformer(["eval-tasks", "--workdir", str(run), "--tasks", str(tasks), "--which", "latest"]) == 0
    return json.loads((run / "eval_tasks" / "alice_mc.json").read_text())


def summary(result):
    return {k: f"{m['value']:.2f} ± {m['stderr']:.2f}" for k, m in result["metrics"].items()}


before = scores(base)
print("before:", summary(before))

# %% [markdown]
# ## Fine-tune with adapters on q and v
#
# `train.init_from` puts fresh adapters (B = 0: the model unchanged at step 0) around the imported weights;
# only the adapters train and have optimizer state.

# %%
tuned = work / "lora"
assert jaxformer(["train", str(base / "config.json"), "--workdir", str(tuned), "--no-progress",
                  "--set", f"train.init_from={base}", "--set", "model.lora.rank=8", "--set", "model.lora.targets=q,v",
                  "--set", "optim.lr=1e-2", "--set", "train.steps=150", "--set", "train.eval_every=150",
                  "--set", "train.checkpoint_every=150", "--set", "train.log_every=50"]) == 0
def bits_per_byte(run):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], round(r["bits_per_byte"], 3)) for r in rows if r["split"] == "eval"]


print("held-out bits per byte (step, value): imported", bits_per_byte(base), "| fine-tuned", bits_per_byte(tuned))
after = scores(tuned)
print("after:", summary(after))

# %% [markdown]
# ## Out as a PEFT adapter
#
# `export-hf --adapter` writes `adapter_config.json` and `adapter_model.safetensors` in PEFT's layout over the
# imported model; `peft` loads them onto transformers' Llama and gives the fine-tuned logits.

# %%
adapter = work / "adapter"
assert jaxformer(["export-hf", "--workdir", str(tuned), "--out", str(adapter), "--adapter"]) == 0
try:
    import peft
except ImportError:                                  # peft is a test extra
    peft = None
if peft is not None:
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(llama, adapter).eval()(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(load_model(tuned, "latest").model(jnp.asarray(ids))[0])
    print("max |jaxformer - peft| logits after fine-tuning:", float(np.abs(ours - theirs).max()))
    assert np.allclose(ours, theirs, atol=2e-4)
