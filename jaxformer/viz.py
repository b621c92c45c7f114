"""Attention heatmaps of a trained run: `jaxformer viz --workdir RUN [--prompt TEXT ...] [--which best|latest]
[--out DIR]`.

For each prompt, every layer's attention probabilities (the `pattern` sites captured, `PATTERNS`: the probabilities
the attention op itself computes) are drawn as one PNG per layer
and attention kind, the heads as a grid of subplots, rows = queries, columns = keys, one token per row/column.
Encoder-decoder runs: encoder self-attention over the prompt (+ EOS), decoder self- and cross-attention for the
decoder input BOS + the model's own greedy answer (without its EOS), so the axes show what the model produced.
Decoder-only runs: the causal self-attention over the prompt.

Files: OUT/prompt{i}-{kind}-layer{l}.png (kind: encoder_self, decoder_self, decoder_cross, or self), OUT defaults
to RUN/viz/. Several calls may write into one OUT (one per --plot, or again): each replaces only the files jaxformer
wrote there (listed in OUT/.jaxformer-viz); a file of a name it would write that a user put there is refused, by
name, before anything is written (`write_figures`). Each file is written whole. Rendering uses matplotlib's Agg canvas directly (no pyplot, no global backend switch).
Axis legend: L layers, N heads, T query length, S key length.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import textwrap
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from jaxformer.arch import architecture
from jaxformer.errors import ConfigError, DataError
from jaxformer.inference import LoadedModel, default_prompts, load_model, prompt_ids
from jaxformer.runs import RunDir

log = logging.getLogger("jaxformer")

KINDS = {   # kind -> (title, query axis, key axis)
    "encoder_self": ("encoder self-attention", "source (query)", "source (key)"),
    "decoder_self": ("decoder self-attention", "decoder input (query)", "decoder input (key)"),
    "decoder_cross": ("decoder cross-attention", "decoder input (query)", "source (key)"),
    "self": ("self-attention", "prompt (query)", "prompt (key)"),
}
_READABLE = {" ": "␣", "\n": "⏎", "\t": "\\t", "\r": "\\r"}


@dataclasses.dataclass
class AttentionMaps:
    """One prompt's attention: probs[kind] [L,N,T,S] float32 with the T query and S key token labels."""
    prompt: str
    answer: str | None                     # the greedy answer's token labels (encoder-decoder runs), else None
    probs: dict[str, np.ndarray]
    queries: dict[str, list[str]]
    keys: dict[str, list[str]]


def token_label(tokenizer, i: int) -> str:
    """A readable label for one token id: <pad>/<bos>/<eos>/<eod>, ␣ for a space, ⏎ for a newline, escapes
    otherwise (a subword token shows its whole text)."""
    i = int(i)
    for name in ("pad", "bos", "eos", "eod"):
        if getattr(tokenizer, f"{name}_id", None) == i:
            return f"<{name}>"
    s = tokenizer.decode([i])
    if not s:
        return f"<{i}>"
    return "".join(_READABLE.get(c, c if c.isprintable() else repr(c)[1:-1]) for c in s)


def encode_prompt(run: LoadedModel, prompt: str) -> np.ndarray:
    """A prompt's token ids as the model reads them (+ EOS for an encoder-decoder's source). DataError for a
    character outside the vocabulary (or a non-digit for a digit task), an empty prompt, or one too long."""
    tok, cfg = run.tokenizer, run.cfg.model
    ids = prompt_ids(tok, prompt)
    row = architecture(cfg.arch).prompt_row(tok, ids)
    try:
        cfg.check_length(len(row), f"prompt {prompt[:40]!r}" + (" (with its EOS)" if len(row) > len(ids) else ""))
    except ConfigError as e:
        raise DataError(str(e)) from None
    return row


PATTERNS = {"decoder_only": {"self": "pattern"},            # what each map is: the `pattern` sites (`nn.sites`)
            "encoder_decoder": {"encoder_self": "encoder.pattern", "decoder_self": "pattern",
                                "decoder_cross": "cross_pattern"}}


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _probs(graphdef, state, args, kw):
    """Every layer's attention probabilities, the `pattern` sites captured: {map name: [L,B,N,T,S]}."""
    model = nnx.merge(graphdef, state)
    names = PATTERNS[model.cfg.arch]
    captured = model(*args, capture=tuple(names.values()), **kw)[1]["captured"]
    return {key: captured[site] for key, site in names.items()}


def attention_maps(run: LoadedModel, prompts: list[str]) -> list[AttentionMaps]:
    """Every layer's attention probabilities for each prompt. The prompts run as one right-padded batch (one compiled
    program whatever their lengths); each prompt's maps are cut to its own tokens, which padding does not
    change (padded keys get weight 0, padded queries are dropped). An encoder-decoder run is shown decoding its
    own greedy answer (`jaxformer.arch`)."""
    tok, cfg = run.tokenizer, run.cfg.model
    rows = [encode_prompt(run, p) for p in prompts]
    table = cfg.max_len if cfg.positional in ("sinusoidal", "learned") else None
    (args, kw), axes, answers = architecture(cfg.arch).attention_inputs(run.model, tok, rows, cfg.pad_id, table)
    graphdef, state = nnx.split(run.model)
    w = {k: np.asarray(v) for k, v in _probs(graphdef, state, args, kw).items()}      # kind: [L,B,N,T,S]
    label = lambda xs: [token_label(tok, x) for x in xs]                              # noqa: E731
    maps = []
    for b, (p, ax, ans) in enumerate(zip(prompts, axes, answers)):
        answer = None if ans is None else "".join(label(ans))
        maps.append(AttentionMaps(p, answer, {k: w[k][:, b, :, :len(q), :len(kk)] for k, (q, kk) in ax.items()},
                                  {k: label(q) for k, (q, _) in ax.items()},
                                  {k: label(kk) for k, (_, kk) in ax.items()}))
    return maps


def plot_heads(w: np.ndarray, queries: list[str], keys: list[str], *, title: str, query_axis: str = "query",
               key_axis: str = "key", dpi: int = 100) -> Figure:
    """w [N,T,S] -> a figure of N heatmaps (a grid, up to 4 per row) on a shared 0..1 colour scale."""
    n, t, s = w.shape
    cols = min(n, 4)
    rows = -(-n // cols)
    cell = min(0.3, 7.0 / max(t, s))                      # inches per token; a head stays within ~7 inches
    font = max(4.0, min(8.0, 26 * cell))
    fig = Figure(figsize=(cols * (cell * s + 1.0) + 1.2, rows * (cell * t + 1.1) + 0.6), dpi=dpi,
                 layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    image = None
    for h, ax in enumerate(axes.flat):
        if h >= n:
            ax.set_axis_off()
            continue
        image = ax.imshow(w[h], vmin=0.0, vmax=1.0, cmap="viridis", interpolation="nearest", aspect="equal")
        ax.set_title(f"head {h}", fontsize=font + 1)
        ax.set_xticks(range(s), keys, rotation=90, fontsize=font, parse_math=False)
        ax.set_yticks(range(t), queries, fontsize=font, parse_math=False)
        ax.tick_params(length=0)
        if h % cols == 0:
            ax.set_ylabel(query_axis, fontsize=font)
        if h // cols == rows - 1:
            ax.set_xlabel(key_axis, fontsize=font)
    fig.colorbar(image, ax=axes, shrink=0.8).set_label("attention weight", fontsize=font)
    fig.suptitle(title, fontsize=font + 2, parse_math=False)
    return fig


def write_figures(out: Path, writers: dict, named: bool = False) -> list[Path]:
    """Write {file name: write(path)} into `out` (created) with `jaxformer.staging.write_kept`: each file whole,
    replacing only files jaxformer wrote there (its manifest, `.jaxformer-viz`); any other file of one of those
    names (a user's) raises OutputError before anything is written. named: `out` is the user's --out."""
    from jaxformer.staging import write_kept
    return write_kept(out, writers, what="--out" if named else None)


def _map_writers(maps: AttentionMaps, index: int, dpi: int = 100) -> dict:
    """{file name: write(path)} of one prompt's maps: one PNG per layer and kind, drawn as it is written."""
    shown = repr(maps.prompt) if len(maps.prompt) <= 60 else repr(maps.prompt[:57] + "...")
    if maps.answer is not None:
        shown += f" -> {maps.answer!r}"
    writers = {}
    for kind, w in maps.probs.items():
        name, q_axis, k_axis = KINDS[kind]
        for layer in range(w.shape[0]):
            def write(path, kind=kind, layer=layer, w=w, name=name, q_axis=q_axis, k_axis=k_axis):
                plot_heads(w[layer], maps.queries[kind], maps.keys[kind], dpi=dpi, query_axis=q_axis, key_axis=k_axis,
                           title=f"{name}, layer {layer} — prompt {index}: {shown}").savefig(path, dpi=dpi)
            writers[f"prompt{index}-{kind}-layer{layer}.png"] = write
    return writers


def write_maps(maps: AttentionMaps, index: int, out: Path, dpi: int = 100) -> list[Path]:
    """One PNG per layer and kind of one prompt's maps, in `out` (created; `write_figures`: a user's file of one
    of those names is refused, never replaced)."""
    return write_figures(Path(out), _map_writers(maps, index, dpi))


def write_heatmaps(workdir: str | Path, prompts: list[str] | None = None, which: str = "best",
                   out: str | Path | None = None, *, dpi: int = 100, weights: str = "trained") -> list[Path]:
    """Restore a run's best (or latest) model (weights: `load_model`'s) and write its attention heatmaps for `prompts`
    (default: the first held-out inputs, `jaxformer.inference.default_prompts`) into `out` (default RUN/viz/):
    one set of figures per prompt, see the module docstring. -> the written paths, in order. Every prompt is
    checked before any figure is written (a bad prompt raises DataError, naming it), and so is `out`: a file
    there of a name it writes that jaxformer did not write raises OutputError (`write_figures`)."""
    run = load_model(workdir, which, weights=weights)
    prompts = list(prompts) if prompts else default_prompts(run)
    maps = attention_maps(run, prompts)                 # checks every prompt before anything is written
    named, out = out is not None, RunDir(workdir).viz_path if out is None else Path(out)
    log.info("%s: %s checkpoint (step %d); heatmaps of %d prompt(s) into %s", workdir, run.which, run.step,
             len(prompts), out)
    return write_figures(out, {n: w for i, m in enumerate(maps) for n, w in _map_writers(m, i, dpi).items()}, named)


# ------------------------------------------------------------------ the logit lens and the head-ablation table

PLOTS = ("attention", "lens", "heads")


@dataclasses.dataclass
class NextTokens:
    """The decoder inputs of a batch of prompts and the token each position should predict: targets [B,T]
    (weights [B,T]: 1 where a position has one), queries: each prompt's decoder-input ids."""
    args: tuple
    kw: dict
    queries: list[np.ndarray]
    targets: np.ndarray
    weights: np.ndarray


def next_tokens(run: LoadedModel, prompts: list[str]) -> NextTokens:
    """A language model's prompt predicts each next prompt token; an encoder-decoder's decoder input (BOS + its
    own greedy answer) predicts the answer, then EOS."""
    tok, cfg = run.tokenizer, run.cfg.model
    rows = [encode_prompt(run, p) for p in prompts]
    table = cfg.max_len if cfg.positional in ("sinusoidal", "learned") else None
    (args, kw), axes, answers = architecture(cfg.arch).attention_inputs(run.model, tok, rows, cfg.pad_id, table)
    queries = [ax["self" if "self" in ax else "decoder_self"][0] for ax in axes]
    width = args[-1].shape[1]
    targets, weights = np.zeros((len(rows), width), np.int32), np.zeros((len(rows), width), np.float32)
    for b, (q, ans) in enumerate(zip(queries, answers)):
        nxt = q[1:] if ans is None else np.append(ans, tok.eos_id)
        targets[b, :len(nxt)], weights[b, :len(nxt)] = nxt, 1.0
    return NextTokens(args, kw, queries, targets, weights)


def plot_lens(probs: np.ndarray, top: list[list[str]], queries: list[str], *, title: str, dpi: int = 100) -> Figure:
    """probs [L+1,T] (the lens's probability of the next token: colour) and top [L+1][T] (each layer's most
    likely token: text) -> one figure, rows embed, layer 0 .. L-1, columns the input tokens."""
    rows, t = probs.shape
    cell = min(0.45, 9.0 / max(t, 1))
    fig = Figure(figsize=(cell * t + 2.4, 0.32 * rows + 1.6), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    image = ax.imshow(probs, vmin=0.0, vmax=1.0, cmap="magma", aspect="auto", interpolation="nearest")
    for i in range(rows):
        for j in range(t):
            ax.text(j, i, top[i][j], ha="center", va="center", fontsize=6, parse_math=False,
                    color="black" if probs[i, j] > 0.6 else "white")
    ax.set_xticks(range(t), queries, rotation=90, fontsize=7, parse_math=False)
    ax.set_yticks(range(rows), ["embed"] + [f"layer {i}" for i in range(rows - 1)], fontsize=7)
    ax.set_xlabel("input token (the cell's text: that layer's most likely next token)", fontsize=7)
    fig.colorbar(image, ax=ax, shrink=0.8).set_label("probability of the actual next token", fontsize=7)
    fig.suptitle(title, fontsize=8, parse_math=False)
    return fig


def plot_head_table(table: np.ndarray, *, title: str, dpi: int = 100) -> Figure:
    """table [L,N] of loss increases -> a heatmap (0 white; a head that helps is red), each cell's value."""
    layers, heads = table.shape
    fig = Figure(figsize=(0.6 * heads + 2.2, 0.45 * layers + 1.4), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    top = float(np.abs(table).max()) or 1.0
    image = ax.imshow(table, cmap="RdBu_r", vmin=-top, vmax=top, aspect="auto", interpolation="nearest")
    for i in range(layers):
        for j in range(heads):
            ax.text(j, i, f"{table[i, j]:.2g}", ha="center", va="center", fontsize=6,
                    color="white" if abs(table[i, j]) > 0.6 * top else "black")
    ax.set_xticks(range(heads), [str(h) for h in range(heads)], fontsize=7)
    ax.set_yticks(range(layers), [f"layer {i}" for i in range(layers)], fontsize=7)
    ax.set_xlabel("head", fontsize=7)
    fig.colorbar(image, ax=ax, shrink=0.8).set_label("loss increase when the head is zeroed (nats)", fontsize=7)
    fig.suptitle(textwrap.fill(title, int(fig.get_figwidth() * 14)), fontsize=8, parse_math=False)
    return fig


HEAD_TABLES = (("z", "heads", "self-attention"), ("cross_z", "heads-cross", "cross-attention"),
               ("encoder.z", "heads-encoder", "the encoder's self-attention"))    # site, file name, what it is


def write_probes(workdir: str | Path, prompts: list[str] | None = None, plots=("lens", "heads"),
                 which: str = "best", out: str | Path | None = None, *, dpi: int = 100,
                 weights: str = "trained") -> list[Path]:
    """The logit lens of each prompt (OUT/prompt{i}-lens.png) and the head-ablation tables over all of them
    (OUT/heads.png; an encoder-decoder's cross-attention and encoder too: heads-cross.png, heads-encoder.png),
    `jaxformer.interpret`'s, for a run's best (or latest) model. -> the written paths. DataError for a bad
    prompt, or with "heads" a prompt of one token (nothing to score), before anything is written; OutputError
    for a file in `out` of a name it writes that jaxformer did not write (`write_figures`), likewise."""
    from jaxformer.interpret import head_ablation, logit_lens
    run = load_model(workdir, which, weights=weights)
    prompts = list(prompts) if prompts else default_prompts(run)
    nt = next_tokens(run, prompts)
    lone = [p for p, w in zip(prompts, nt.weights) if not w.any()]
    if "heads" in plots and lone:               # its row would add 0 to every head's loss increase
        raise DataError(f"--plot heads: prompt {lone[0][:40]!r} is a single token, with no next token to score; "
                        f"a head's loss increase needs prompts of at least 2 tokens")
    named, out = out is not None, RunDir(workdir).viz_path if out is None else Path(out)
    label = lambda xs: [token_label(run.tokenizer, x) for x in xs]                    # noqa: E731
    figures = {}                                                                      # file name -> figure
    if "lens" in plots:
        lens = np.asarray(jax.nn.softmax(jax.jit(lambda *a, **k: logit_lens(run.model, *a, **k))(*nt.args, **nt.kw)))
        for b, (p, q) in enumerate(zip(prompts, nt.queries)):
            probs = np.take_along_axis(lens[:, b, :len(q)], nt.targets[b, None, :len(q), None], -1)[..., 0]
            probs = probs * nt.weights[b, :len(q)]                                    # no next token: blank
            top = [label(np.argmax(lens[i, b, :len(q)], -1)) for i in range(lens.shape[0])]
            figures[f"prompt{b}-lens.png"] = plot_lens(probs, top, label(q), dpi=dpi,
                                                       title=f"logit lens — prompt {b}: {p[:60]!r}")
    for site, name, what in HEAD_TABLES if "heads" in plots else ():
        if site not in run.model.sites():
            continue
        table = np.asarray(head_ablation(run.model, *nt.args, targets=nt.targets, weights=nt.weights, site=site,
                                         **nt.kw))
        figures[f"{name}.png"] = plot_head_table(table, dpi=dpi, title=f"head ablation ({what}) over "
                                                 f"{len(prompts)} prompt(s): loss increase on the next tokens when "
                                                 "one head's output is zeroed")
    paths = write_figures(out, {n: lambda path, fig=fig: fig.savefig(path, dpi=dpi) for n, fig in figures.items()},
                          named)
    log.info("%s: %s checkpoint (step %d); %s of %d prompt(s) into %s", workdir, run.which, run.step,
             "/".join(p for p in plots if p != "attention"), len(prompts), out)
    return paths
