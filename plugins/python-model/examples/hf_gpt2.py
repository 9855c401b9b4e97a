"""Hugging Face's GPT-2 (transformers.GPT2LMHeadModel), small and randomly initialised, for
trainerd's Python model plugin: a model from a library, trained as it is.

    trainerd run --plugin libpython_model.so --plugin-arg module=hf_gpt2.py --data DIR ...

DIR as tokenize.py writes it (its defaults: a 512-id byte-level BPE, rows of 128 tokens). Built
from a GPT2Config alone: nothing is downloaded, no network is touched. Attention is transformers'
"eager" implementation (matmul, softmax, matmul: the same kernels on CPU and CUDA, deterministic
under torch.use_deterministic_algorithms); attention="sdpa" picks
torch.nn.functional.scaled_dot_product_attention instead. The LM head is tied to the token
embedding (GPT-2's default): the module's state_dict() names the one tensor twice
(transformer.wte.weight and lm_head.weight), parameters() once.
"""
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

# Tokens per row (the position table's size): fixed, since trainerd reads `columns` before it
# calls model().
CONTEXT = 128

arguments = {
    "vocab": "512",  # tokenize.py's default BPE; 258 for --tokenizer bytes
    "n_embd": "64",
    "n_layer": "2",
    "n_head": "2",
    "dropout": "0.0",  # GPT-2's embedding, residual and attention dropout alike
    "attention": "eager",  # or "sdpa"
}

columns = {"input_ids": f"tokens:{CONTEXT}"}

language_model = True


def model(args):
    dropout = float(args["dropout"])
    config = GPT2Config(
        vocab_size=int(args["vocab"]),
        n_positions=CONTEXT,
        n_embd=int(args["n_embd"]),
        n_layer=int(args["n_layer"]),
        n_head=int(args["n_head"]),
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        use_cache=False,
        # tokenize.py's ids (GPT-2's own, 50256, lie outside a small vocabulary: transformers warns).
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
        attn_implementation=args["attention"],
    )
    module = GPT2LMHeadModel(config)
    # transformers finds no loss for the class name GPT2LMHeadModel and warns before using
    # ForCausalLM's; name it.
    module.loss_type = "ForCausalLM"
    return module


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
