"""Inference: restore a trained model (`load_model`), evaluate it (`evaluate`, `evaluate_run`, `examples`) and
prompt it (`generate_text`). Outside `train/`: nothing here imports the optimizer or the training loop."""
from jaxformer.data import pad_rows
from jaxformer.inference.evaluate import evaluate, evaluate_run, examples, make_eval_step
from jaxformer.inference.generate import default_prompts, generate_text, prompt_ids
from jaxformer.inference.restore import LoadedModel, abstract_model, load_model

__all__ = ["evaluate", "evaluate_run", "examples", "make_eval_step", "default_prompts", "generate_text", "pad_rows",
           "prompt_ids", "LoadedModel", "abstract_model", "load_model"]
