"""Reading and writing Hugging Face checkpoint folders: `config.json` and one or several `*.safetensors` files
(with `model.safetensors.index.json`), read with `safetensors` (numpy; never torch).

Loading goes parameter by parameter straight into the target shardings: each device's shard of a parameter
is assembled from the tensors it needs (`jax.make_array_from_callback`), so at most one tensor (and the shard
being built) is ever on the host, and a model larger than one device's memory never exists whole anywhere.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from jaxformer.hf.expressing import check_family, family_for, to_hf_config
from jaxformer.hf.families import HFError, family_of, to_model_config
from jaxformer.hf.mapping import Tensor, canonical_name, tensors
from jaxformer.nn import build_model
from jaxformer.nn.lora import merged
from jaxformer.nn.stack import blocks_path
from jaxformer.parallel import Plan, abstract_with_shardings, no_mesh

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def read_config(path: str | Path) -> dict:
    """The config.json of a Hugging Face checkpoint folder, parsed (`to_model_config` reads it into a model config).

    Args:
      path: the checkpoint folder (config.json and its safetensors files).

    Returns:
      config.json as a dict.

    Raises:
      HFError: the folder has no config.json, it is unreadable (not UTF-8, not JSON), or not a JSON object.

    Examples:
      >>> import json, os, tempfile
      >>> from jaxformer.hf import read_config
      >>> folder = tempfile.mkdtemp()
      >>> with open(os.path.join(folder, "config.json"), "w") as f:
      ...     json.dump({"model_type": "llama", "hidden_size": 16}, f)
      >>> read_config(folder)
      {'model_type': 'llama', 'hidden_size': 16}
      >>> read_config(tempfile.mkdtemp())
      Traceback (most recent call last):
      ...
      jaxformer.hf.families.HFError: '...' has no config.json (not a Hugging Face checkpoint folder)
    """
    p = Path(path) / "config.json"
    if not p.is_file():
        raise HFError(f"{str(path)!r} has no config.json (not a Hugging Face checkpoint folder)")
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFError(f"{p} is unreadable: {type(e).__name__}: {e}") from None
    if not isinstance(d, dict):
        raise HFError(f"{p} is not a JSON object")
    return d


class _Files:
    """The checkpoint's tensors by name, opened lazily (safetensors' safe_open, numpy)."""

    def __init__(self, path: Path, family: str):
        from safetensors import safe_open
        self._open, self.path, self.handles = safe_open, path, {}
        if (path / INDEX).is_file():
            try:
                weight_map = json.loads((path / INDEX).read_text(encoding="utf-8"))["weight_map"]
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise HFError(f"{path / INDEX} is unreadable: {type(e).__name__}: {e}") from None
            files = sorted(set(weight_map.values()))
        elif (path / SINGLE).is_file():
            files = [SINGLE]
        else:
            raise HFError(f"{str(path)!r} has neither {SINGLE} nor {INDEX}")
        self.where: dict[str, tuple[str, str]] = {}        # canonical name -> (file, name in the file)
        for file in files:
            for name in self._handle(file).keys():
                canon = canonical_name(name, family)
                if canon is not None:
                    self.where[canon] = (file, name)

    def _handle(self, file: str):
        if file not in self.handles:
            try:
                self.handles[file] = self._open(str(self.path / file), framework="numpy")
            except Exception as e:          # safetensors raises SafetensorError / OSError with the reason
                raise HFError(f"{self.path / file} is not a readable safetensors file: {str(e)[:200]}") from None
        return self.handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        file, key = self.where[name]
        return tuple(self._handle(file).get_slice(key).get_shape())

    def dtype(self, name: str) -> str:
        file, key = self.where[name]
        return self._handle(file).get_slice(key).get_dtype()

    def read(self, name: str) -> np.ndarray:
        """The tensor as float32; HFError if it cannot be read or holds a NaN or an infinity (a model that
        computes NaN is never imported)."""
        file, key = self.where[name]
        try:
            a = np.asarray(self._handle(file).get_tensor(key)).astype(np.float32, copy=False)
        except Exception as e:
            raise HFError(f"tensor {name!r} of {self.path / file} is unreadable: {str(e)[:200]}") from None
        finite = np.isfinite(a)
        if not finite.all():
            bad = int(a.size - np.count_nonzero(finite))
            where = tuple(int(i) for i in np.argwhere(~finite)[0])
            raise HFError(f"tensor {name!r} of {self.path / file} holds {bad} non-finite value(s) (NaN or "
                          f"infinity; the first at index {where}: {a[where]}); a checkpoint with them is refused")
        return a


def _plan_of(specs: list[Tensor], files: _Files, abstract: dict, family: str, tied: bool):
    """{path: {layer or None: (tensor, output index)}}: every parameter filled exactly once, every tensor of the
    files used (HFError naming what is missing, unexpected, misshapen or doubly written)."""
    missing = [t.name for t in specs if t.name not in files.where]
    expected = {t.name for t in specs}
    extra = sorted(n for n in files.where if n not in expected and not (tied and n == "lm_head.weight"))
    if missing or extra:
        raise HFError(f"the {family} checkpoint does not match its config: "
                      + (f"missing tensor(s) {missing[:8]}{' …' if len(missing) > 8 else ''}" if missing else "")
                      + ("; " if missing and extra else "")
                      + (f"unexpected tensor(s) {extra[:8]}{' …' if len(extra) > 8 else ''}" if extra else ""))
    for t in specs:
        if files.shape(t.name) != t.shape:
            raise HFError(f"tensor {t.name!r} has shape {files.shape(t.name)}; the config implies {t.shape}")
    fills: dict[tuple, dict] = {}
    for t in specs:
        for j, path in enumerate(t.ours):
            slot = fills.setdefault(path, {})
            if t.layer in slot:
                raise HFError(f"parameter {'/'.join(path)} layer {t.layer} is written twice")
            slot[t.layer] = (t, j)
    for path, leaf in abstract.items():
        want = {None} if path[:3] != blocks_path("decoder") else set(range(leaf.shape[0]))
        if set(fills.get(path, {})) != want:
            raise HFError(f"parameter {'/'.join(path)} is not written exactly once per layer by the mapping")
    unused = sorted('/'.join(p) for p in set(fills) - set(abstract))
    if unused:
        raise HFError(f"the mapping writes parameters the model lacks: {unused[:8]}")
    return fills


def _assemble(leaf: jax.ShapeDtypeStruct, slot: dict, files: _Files) -> jax.Array:
    """One parameter in its sharding: each device's shard built from the tensors it covers."""
    def shard(index):
        if None in slot:
            t, j = slot[None]
            return t.load(files.read(t.name))[j][index]
        rows = range(leaf.shape[0])[index[0]]
        return np.stack([slot[i][0].load(files.read(slot[i][0].name))[slot[i][1]][index[1:]] for i in rows])
    return jax.make_array_from_callback(leaf.shape, leaf.sharding,
                                        lambda idx: np.array(shard(idx), dtype=leaf.dtype))   # the shard alone


def from_pretrained(path: str | Path, *, dtype: str | None = None, plan: Plan | None = None):
    """A Hugging Face checkpoint folder (config.json + safetensors) -> a jaxformer model (nnx module) computing
    the same logits.

    The model is an ordinary `jaxformer.nn` model: it takes `capture=` and `patch=` (activation sites,
    `jaxformer.nn.sites`), decodes with `jaxformer.decode`, and trains or is saved back (`save_pretrained`).
    Each parameter is read straight into its shards (module docstring): at most one tensor is on the host at a
    time. Needs `safetensors`, never torch.

    Args:
      path: the checkpoint folder: config.json (a `model_type` of `FAMILIES`) and model.safetensors, or several
        safetensors files with model.safetensors.index.json.
      dtype: the compute dtype (model.runtime.dtype: "float32", "bfloat16" or "float16"; None = float32);
        parameters are float32 as in training, whatever the file's dtype.
      plan: a `jaxformer.parallel.Plan`: load straight into its shardings (else onto this process's first
        device).

    Returns:
      The model (decoder-only; `model.cfg` is `to_model_config(read_config(path))`), its logits [B, T, V] those
        of transformers' model of the folder.

    Raises:
      HFError: no config.json, an unsupported family or config key (`to_model_config`), no safetensors file,
        tensors missing, unexpected or of another shape than the config implies, an unreadable file, or a tensor
        holding a NaN or an infinity (naming it).

    Examples:
      >>> import os, tempfile
      >>> import jax.numpy as jnp
      >>> from jaxformer.hf import from_pretrained, save_pretrained, to_model_config
      >>> from jaxformer.nn import build_model
      >>> cfg = to_model_config({"model_type": "llama", "vocab_size": 16, "hidden_size": 16,
      ...                        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
      ...                        "max_position_embeddings": 16})
      >>> original = build_model(cfg, seed=0)
      >>> folder = os.path.join(tempfile.mkdtemp(), "tiny-llama")
      >>> _ = save_pretrained(original, folder)               # a Llama checkpoint folder, as transformers writes
      >>> model = from_pretrained(folder)
      >>> tokens = jnp.array([[1, 2, 3, 4]])
      >>> logits, out = model(tokens, capture=("resid_post",))  # an activation site, as of any jaxformer model
      >>> logits.shape, out["captured"]["resid_post"].shape      # [B, T, V], [L, B, T, D]
      ((1, 4, 16), (1, 1, 4, 16))
      >>> bool(jnp.allclose(logits, original(tokens)[0], atol=1e-6))
      True
    """
    path = Path(path)
    d = read_config(path)
    family = family_of(d)
    cfg = to_model_config(d, dtype or "float32")
    files = _Files(path, family)
    with no_mesh():
        graph, abstract = nnx.split(nnx.eval_shape(lambda: build_model(cfg)))
    abstract = abstract_with_shardings(abstract, plan)
    leaves = {tuple(str(k.key) for k in p): v
              for p, v in jax.tree_util.tree_flatten_with_path(abstract.to_pure_dict())[0]}
    fills = _plan_of(tensors(cfg, family), files, leaves, family, cfg.tie_embeddings)
    arrays = {p: _assemble(leaves[p], fills[p], files) for p in leaves}
    pure = {}
    for p, a in arrays.items():
        node = pure
        for k in p[:-1]:
            node = node.setdefault(k, {})
        node[p[-1]] = a
    nnx.replace_by_pure_dict(abstract, pure)
    return nnx.merge(graph, abstract)


def _host(x) -> np.ndarray:
    return np.asarray(jax.device_get(x), np.float32)


def save_pretrained(model, path: str | Path, *, family: str | None = None, dtype: str = "float32",
                    max_shard_bytes: int = 5 << 30, token_ids: dict | None = None) -> dict:
    """Write `model` as a Hugging Face checkpoint folder (`write_pretrained`), whole or not at all: `path` must
    not exist or be empty (`hf.staging`: written to PATH.partial, renamed when complete; nothing already there is
    ever replaced).

    `transformers.AutoModelForCausalLM.from_pretrained(path)` loads the folder and computes the model's logits;
    so does `from_pretrained`. The family is held to the model: an export that would write another model (a
    switch the family's config.json cannot say) is refused before anything is written. A model with low-rank
    adapters is written with them merged into its weights.

    Args:
      model: a decoder-only `jaxformer.nn` model (trained here, or loaded by `from_pretrained`).
      path: the folder to write: absent, or an empty folder.
      family: the family to write, one of `FAMILIES` (None: `family_for(model.cfg)`).
      dtype: the tensors' dtype in the files: "float32", "bfloat16" or "float16".
      max_shard_bytes: the largest safetensors file; a larger model is cut into several files with
        model.safetensors.index.json.
      token_ids: token ids for config.json, e.g. {"bos_token_id": 1, "eos_token_id": 2}.

    Returns:
      The config.json written, as a dict (its "model_type" the family, "torch_dtype" the dtype).

    Raises:
      HFError: no family expresses the model, or `family` is unknown or cannot express it exactly (naming the
        fields, and the families that can); an unknown dtype; `path` is not free (naming what it holds).

    Examples:
      >>> import os, tempfile
      >>> from jaxformer.config import replaced
      >>> from jaxformer.hf import save_pretrained, to_model_config
      >>> from jaxformer.nn import build_model
      >>> cfg = to_model_config({"model_type": "llama", "vocab_size": 16, "hidden_size": 16,
      ...                        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
      ...                        "max_position_embeddings": 16})
      >>> model = build_model(replaced(cfg, attention__qk_norm=True), seed=0)
      >>> folder = os.path.join(tempfile.mkdtemp(), "tiny-qwen3")
      >>> hf = save_pretrained(model, folder, dtype="bfloat16")
      >>> hf["model_type"], hf["architectures"], hf["torch_dtype"]    # QK-norm: chosen as Qwen3
      ('qwen3', ['Qwen3ForCausalLM'], 'bfloat16')
      >>> sorted(os.listdir(folder))
      ['config.json', 'model.safetensors']
      >>> save_pretrained(model, folder)
      Traceback (most recent call last):
      ...
      jaxformer.hf.families.HFError: --out ... is not empty (it holds config.json, model.safetensors); ...
      >>> save_pretrained(model, os.path.join(tempfile.mkdtemp(), "out"), family="llama")
      Traceback (most recent call last):
      ...
      jaxformer.hf.families.HFError: the llama family cannot express this model, ...: model.attention.qk_norm=True
      (a llama config gives False) (families that can: qwen3)
    """
    from jaxformer.hf.staging import staged
    exported_config(model, family, dtype, token_ids)            # refused before anything is written
    with staged(path) as tmp:
        return write_pretrained(model, tmp, family=family, dtype=dtype, max_shard_bytes=max_shard_bytes,
                                token_ids=token_ids)


def exported_config(model, family: str | None, dtype: str, token_ids: dict | None = None) -> dict:
    """The config.json `model` exports as: its family's (`family_for` unless given, held to `check_family`) with
    torch_dtype and token_ids. HFError: no family (or not the one given) expresses it, or an unknown dtype."""
    cfg = model.cfg.function()
    family = family or family_for(cfg)
    check_family(cfg, family)                      # forced or chosen: it must write this very model
    if dtype not in DTYPES:
        raise HFError(f"dtype={dtype!r}: expected float32, bfloat16 or float16")
    hf = to_hf_config(cfg, family)
    hf.update({"torch_dtype": dtype, **(token_ids or {})})
    return hf


def write_pretrained(model, path: str | Path, *, family: str | None = None, dtype: str = "float32",
                     max_shard_bytes: int = 5 << 30, token_ids: dict | None = None) -> dict:
    """Write `model` into the empty folder `path` (an export's staging folder, `hf.staging`): config.json
    (`exported_config`) and safetensors files of at most `max_shard_bytes` each (several: with
    model.safetensors.index.json), tensors in `dtype` (float32 | bfloat16 | float16). token_ids: bos/eos/pad ids
    for config.json. Returns the config written. A model with low-rank adapters (model.lora) is written with them
    merged into its weights (`nn.lora.merged`, on a copy)."""
    from safetensors.numpy import save_file
    hf = exported_config(model, family, dtype, token_ids)
    family, cfg, np_dtype = hf["model_type"], model.cfg.function(), DTYPES[dtype]
    if model.cfg.lora.rank:
        model = merged(nnx.clone(model))
    path = Path(path)
    state = {tuple(str(k) for k in p): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    specs = tensors(cfg, family)
    written = {(p, t.layer) for t in specs for p in t.ours}
    need = {(p, i) for p, v in state.items() for i in ([None] if p[:3] != blocks_path("decoder")
                                                         else range(v[...].shape[0]))}
    if written != need:
        raise HFError(f"the {family} mapping does not write every parameter exactly once: "
                      f"{sorted('/'.join(p) for p, _ in need ^ written)[:8]}")
    shards = _shards(specs, state, np_dtype, max_shard_bytes)
    total = sum(a.nbytes for s in shards for a in s.values())
    names = [SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                               for i in range(len(shards))]
    for name, tensors_ in zip(names, shards):
        save_file(tensors_, str(path / name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: n for n, s in zip(names, shards) for k in sorted(s)}}
        (path / INDEX).write_text(json.dumps(index, indent=1), encoding="utf-8")
    (path / "config.json").write_text(json.dumps(hf, indent=1), encoding="utf-8")
    return hf


DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _shards(specs: list[Tensor], state: dict, np_dtype, max_shard_bytes: int) -> list[dict]:
    """The tensors of `specs` in `np_dtype`, filled from `state` one parameter on the host at a time, cut into
    shards of at most `max_shard_bytes` (a tensor larger than that alone in its shard)."""
    cache: dict = {}

    def ours(p, layer):
        if p not in cache:
            cache.clear()
            cache[p] = _host(state[p][...])
        return cache[p] if layer is None else cache[p][layer]

    shards, current, size = [], {}, 0
    for t in sorted(specs, key=lambda t: (t.ours[0], t.layer or 0)):
        arr = np.ascontiguousarray(t.save(*(ours(p, t.layer) for p in t.ours))).astype(np_dtype)
        if current and size + arr.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[t.name], size = arr, size + arr.nbytes
    shards.append(current)
    return shards
