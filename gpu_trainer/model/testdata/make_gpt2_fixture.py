#!/usr/bin/python3
"""Writes gpt2_torch_fixture.safetensors: a PyTorch GPT-2's loss and gradients for gpt2_test.

Run with Debian's python3-torch (torch 1.13), from the repository root:

  /usr/bin/python3 gpu_trainer/model/testdata/make_gpt2_fixture.py \
      gpu_trainer/model/testdata/gpt2_torch_fixture.safetensors

The model is written here from torch primitives, independently of the C++ one: token + position
embeddings, pre-LayerNorm blocks (causal self-attention, GELU-tanh MLP of width 4C), final
LayerNorm, LM head tied to wte, Conv1D-style (in, out) weights, GPT-2 (Hugging Face) names. It
runs in fp32, as docs/ARCHITECTURE.md section 5 asks (the C++ model is fp32; float64 here would
measure torch's rounding against ours rather than hide it).

Weights are seeded random, not GPT-2's initialisation: every LayerNorm weight and bias and every
linear bias is perturbed too, so no gradient is trivially zero or one, and the weights are large
enough that attention is far from uniform.

The file holds, all little-endian:
  config           I32 (5,)    vocab_size, context_length, num_layers, num_heads, channels
  inputs, targets  I32 (B, T)
  loss             F32 (1,)    mean cross-entropy over the B*T positions
  <name>           F32         every parameter, under its GPT-2 name and shape
  grad.<name>      F32         d loss / d <name>
"""
import argparse
import json
import math
import struct

import torch
import torch.nn.functional as F

CONFIG = dict(vocab_size=96, context_length=32, num_layers=2, num_heads=4, channels=32)
BATCH, SEQ = 2, 16


def param_shapes(c):
    """(name, shape) in the C++ flat layout's order (param_layout.h)."""
    V, maxT, C = c["vocab_size"], c["context_length"], c["channels"]
    shapes = [("wte.weight", (V, C)), ("wpe.weight", (maxT, C))]
    for l in range(c["num_layers"]):
        h = f"h.{l}."
        shapes += [
            (h + "ln_1.weight", (C,)), (h + "ln_1.bias", (C,)),
            (h + "attn.c_attn.weight", (C, 3 * C)), (h + "attn.c_attn.bias", (3 * C,)),
            (h + "attn.c_proj.weight", (C, C)), (h + "attn.c_proj.bias", (C,)),
            (h + "ln_2.weight", (C,)), (h + "ln_2.bias", (C,)),
            (h + "mlp.c_fc.weight", (C, 4 * C)), (h + "mlp.c_fc.bias", (4 * C,)),
            (h + "mlp.c_proj.weight", (4 * C, C)), (h + "mlp.c_proj.bias", (C,)),
        ]
    shapes += [("ln_f.weight", (C,)), ("ln_f.bias", (C,))]
    return shapes


def random_params(c, gen):
    params = {}
    for name, shape in param_shapes(c):
        r = torch.randn(shape, generator=gen, dtype=torch.float32)
        if "ln_" in name and name.endswith(".weight"):
            p = 1.0 + 0.2 * r
        elif name.endswith(".bias"):
            p = 0.1 * r
        else:
            p = 0.15 * r
        params[name] = p.requires_grad_(True)
    return params


def gpt2_loss(p, c, idx, targets):
    B, T = idx.shape
    C, NH = c["channels"], c["num_heads"]
    hs = C // NH
    x = p["wte.weight"][idx] + p["wpe.weight"][:T]  # (B, T, C)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for l in range(c["num_layers"]):
        h = f"h.{l}."
        a = F.layer_norm(x, (C,), p[h + "ln_1.weight"], p[h + "ln_1.bias"], eps=1e-5)
        qkv = a @ p[h + "attn.c_attn.weight"] + p[h + "attn.c_attn.bias"]  # (B, T, 3C)
        q, k, v = qkv.split(C, dim=2)
        q, k, v = (t.view(B, T, NH, hs).transpose(1, 2) for t in (q, k, v))  # (B, NH, T, hs)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)  # (B, NH, T, T)
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        x = x + y @ p[h + "attn.c_proj.weight"] + p[h + "attn.c_proj.bias"]
        m = F.layer_norm(x, (C,), p[h + "ln_2.weight"], p[h + "ln_2.bias"], eps=1e-5)
        m = F.gelu(m @ p[h + "mlp.c_fc.weight"] + p[h + "mlp.c_fc.bias"], approximate="tanh")
        x = x + m @ p[h + "mlp.c_proj.weight"] + p[h + "mlp.c_proj.bias"]
    x = F.layer_norm(x, (C,), p["ln_f.weight"], p["ln_f.bias"], eps=1e-5)
    logits = x @ p["wte.weight"].t()  # (B, T, V)
    return F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))


def write_safetensors(path, tensors):
    """tensors: list of (name, tensor); F32 or I32, written in order (no safetensors package)."""
    dtypes = {torch.float32: "F32", torch.int32: "I32"}
    header, blobs, offset = {}, [], 0
    for name, t in tensors:
        array = t.detach().contiguous().numpy()
        data = array.astype(array.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dtypes[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data section 8-aligned, as the format recommends
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="path of the .safetensors file to write")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    c = CONFIG
    gen = torch.Generator().manual_seed(args.seed)
    params = random_params(c, gen)
    inputs = torch.randint(0, c["vocab_size"], (BATCH, SEQ), generator=gen, dtype=torch.int64)
    targets = torch.randint(0, c["vocab_size"], (BATCH, SEQ), generator=gen, dtype=torch.int64)
    loss = gpt2_loss(params, c, inputs, targets)
    loss.backward()

    config = torch.tensor([c["vocab_size"], c["context_length"], c["num_layers"], c["num_heads"],
                           c["channels"]], dtype=torch.int32)
    tensors = [("config", config), ("inputs", inputs.to(torch.int32)),
               ("targets", targets.to(torch.int32)), ("loss", loss.detach().reshape(1))]
    tensors += [(name, params[name]) for name, _ in param_shapes(c)]
    tensors += [("grad." + name, params[name].grad) for name, _ in param_shapes(c)]
    write_safetensors(args.out, tensors)
    print(f"wrote {args.out}: loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
