"""A small GPT for trainerd's Python model plugin, written as a plain PyTorch module.

    trainerd run --plugin libpython_model.so --plugin-arg module=gpt.py --data DIR ...

DIR as tokenize.py writes it (its defaults: a 512-id byte-level BPE, rows of 128 tokens), or, with
--plugin-arg input=text, raw text (a `text` column) that trainerd tokenizes with the tokenizer.json
beside it and packs into blocks of `context` tokens (tokenize.py --raw writes one). Token
and learned position embeddings, pre-norm blocks of causal self-attention
(scaled_dot_product_attention, is_causal=True) and a GELU MLP, a final LayerNorm, and the output
head tied to the token embedding (the logits are h @ embedding^T, so the state dict holds the
embedding once). Rows are right-padded with id 0: causal attention keeps the real tokens from
seeing the padding, and the loss skips targets that are padding.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

arguments = {
    "vocab": "512",  # tokenize.py's default BPE; 258 for --tokenizer bytes
    "d_model": "128",
    "n_layer": "2",
    "n_head": "4",
    "dropout": "0.0",  # on the embeddings and each residual branch
    "context": "128",  # tokens per example: the position table's size
    "input": "tokens",  # token rows (tokens:LEN), or raw text packed into blocks (text:LEN)
}


def columns(args):
    if args["input"] not in ("tokens", "text"):
        raise ValueError(f"input={args['input']}: expected tokens (token rows) or text (raw text, packed)")
    return {"input_ids": f"{args['input']}:{int(args['context'])}"}

language_model = True


class Block(nn.Module):
    def __init__(self, d_model, n_head, dropout):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, vocab, context, d_model, n_layer, n_head, dropout):
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model {d_model} is not a multiple of n_head {n_head}")
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        # GPT-2's initialisation: N(0, 0.02), the residual projections scaled by 1/sqrt(2 n_layer).
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, input_ids):
        t = input_ids.shape[1]
        positions = torch.arange(t, device=input_ids.device)
        h = self.drop(self.tok(input_ids) + self.pos(positions))
        for block in self.blocks:
            h = block(h)
        return F.linear(self.ln_f(h), self.tok.weight)


def model(args):
    return GPT(
        vocab=int(args["vocab"]),
        context=int(args["context"]),
        d_model=int(args["d_model"]),
        n_layer=int(args["n_layer"]),
        n_head=int(args["n_head"]),
        dropout=float(args["dropout"]),
    )


def _next_tokens(batch):
    """(targets with -100 where the next token is padding, whether each is real): [B, T-1]."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    real = torch.ones_like(ids[:, 1:], dtype=torch.bool) if mask is None else mask[:, 1:] != 0
    return ids[:, 1:].masked_fill(~real, -100), real


def loss(module, batch):
    """Mean next-token cross-entropy over the batch's real next tokens, and the logits (which
    metrics takes, so that a step runs the module once)."""
    logits = module(batch["input_ids"])
    targets, _ = _next_tokens(batch)
    mean = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
    return mean, logits


def metrics(module, batch, logits):
    """accuracy: each example's share of next tokens predicted right (argmax), summed over the
    batch's examples."""
    targets, real = _next_tokens(batch)
    right = (logits[:, :-1].argmax(-1) == targets) & real
    per_example = right.sum(1).to(torch.float32) / real.sum(1).clamp(min=1).to(torch.float32)
    return {"accuracy": per_example.sum()}


def predict(module, batch):
    """The logits at every position: [B, T, vocab]."""
    return module(batch["input_ids"])
