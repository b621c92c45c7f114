"""Hugging Face checkpoints in and out: `from_pretrained(DIR)` builds the jaxformer model computing the same
logits as transformers' model of DIR (Llama, Qwen2, Qwen3, Mistral, GPT-2, Gemma, Gemma 2); `save_pretrained(model, DIR)`
writes one that `transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads. Needs `safetensors`, never torch."""
from jaxformer.hf.checkpoint import from_pretrained, read_config, save_pretrained
from jaxformer.hf.expressing import family_for, to_hf_config
from jaxformer.hf.families import FAMILIES, HFError, to_model_config

__all__ = ["FAMILIES", "HFError", "family_for", "from_pretrained", "read_config", "save_pretrained",
           "to_hf_config", "to_model_config"]
