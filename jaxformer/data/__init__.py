"""Data: tokenizers, text loading, tasks as grain pipelines."""
from jaxformer.data.build import build_task, resolve
from jaxformer.data.tasks import Task, attention_fields, pad_rows
from jaxformer.data.text import load_text
from jaxformer.data.tokenizers import CharTokenizer, DataError, DigitTokenizer, load_tokenizer, save_tokenizer

__all__ = ["Task", "attention_fields", "build_task", "pad_rows", "resolve", "load_text", "CharTokenizer", "DataError",
           "DigitTokenizer", "load_tokenizer", "save_tokenizer"]
