"""Hugging Face's Llama (transformers.LlamaForCausalLM), small and randomly initialised, for
trainerd's Python model plugin: the decoder most language-model users bring, trained as it is.

    trainerd run --plugin libpython_model.so --plugin-arg module=hf_llama.py --data DIR ...

DIR as tokenize.py writes it (its defaults: a 512-id byte-level BPE, rows of 128 tokens). Built
from a LlamaConfig alone: nothing is downloaded, no network is touched. Rotary position
embeddings, RMSNorm, a SwiGLU MLP, grouped-query attention (n_kv_head key/value heads shared by
n_head query heads), and an LM head of its own (Llama's default: not tied to the embedding).
Attention is transformers' "eager" implementation (the same kernels on CPU and CUDA);
attention="sdpa" picks torch.nn.functional.scaled_dot_product_attention instead.
"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

# Tokens per row: fixed, since trainerd reads `columns` before it calls model().
CONTEXT = 128

arguments = {
    "vocab": "512",  # tokenize.py's default BPE; 258 for --tokenizer bytes
    "hidden": "64",
    "intermediate": "176",
    "n_layer": "2",
    "n_head": "4",
    "n_kv_head": "2",
    "tie": "false",  # "true" ties the LM head to the token embedding
    "attention": "eager",  # or "sdpa"
}

columns = {"input_ids": f"tokens:{CONTEXT}"}

language_model = True


def model(args):
    config = LlamaConfig(
        vocab_size=int(args["vocab"]),
        hidden_size=int(args["hidden"]),
        intermediate_size=int(args["intermediate"]),
        num_hidden_layers=int(args["n_layer"]),
        num_attention_heads=int(args["n_head"]),
        num_key_value_heads=int(args["n_kv_head"]),
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=args["tie"] == "true",
        use_cache=False,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
        attn_implementation=args["attention"],
    )
    return LlamaForCausalLM(config)


def _labels(batch):
    """input_ids with -100 where the token is padding (transformers shifts them itself)."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    return ids if mask is None else ids.masked_fill(mask == 0, -100)


def loss(module, batch):
    """Mean next-token cross-entropy over the batch's real next tokens (transformers'
    ForCausalLMLoss: logits[:, :-1] against labels[:, 1:], ignoring -100)."""
    out = module(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), labels=_labels(batch))
    return out.loss, out.logits


def metrics(module, batch, logits):
    """accuracy: each example's share of next tokens predicted right (argmax), summed over the
    batch's examples, from the logits loss returned."""
    targets = _labels(batch)[:, 1:]
    real = targets != -100
    right = (logits[:, :-1].argmax(-1) == targets) & real
    per_example = right.sum(1).to(torch.float32) / real.sum(1).clamp(min=1).to(torch.float32)
    return {"accuracy": per_example.sum()}


def predict(module, batch):
    """The logits at every position: [B, T, vocab]."""
    return module(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
