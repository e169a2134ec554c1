"""
The ViT CLS token
=================

A Vision Transformer prepends a learned "CLS" token to the patch tokens and, after the
last block, classifies from that token alone: ``head(norm(x)[:, 0])``. Because
LayerNorm normalizes each token over its own features, normalizing the whole sequence
and then taking token 0 is the same as taking token 0 and normalizing only it, which
saves normalizing the other ``L - 1`` tokens at inference.
"""

# %%
import numpy as np

import layernorm as ln

rng = np.random.default_rng(0)
B, L, D, D_embed = 8, 197, 384, 10  # ViT-S/16 on 224x224: 196 patches + 1 CLS token
x = rng.standard_normal((B, L, D), dtype=np.float32)
weight = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
bias = (0.1 * rng.standard_normal(D)).astype(np.float32)

full = ln.layer_norm(x, D, weight, bias)[:, 0, :]  # normalize all tokens, keep CLS
cls_only = ln.layer_norm(x[:, 0, :], D, weight, bias)  # keep CLS, normalize it
print("shapes:", full.shape, cls_only.shape)
print("max |difference| =", np.abs(full - cls_only).max())
print("bitwise equal:", np.array_equal(full, cls_only))
assert np.array_equal(full, cls_only)

# %%
# ``x[:, 0, :]`` is a strided view (one token out of every 197); the library accepts any
# strides and still gives the same bits.
print("x[:, 0, :] is C-contiguous:", x[:, 0, :].flags.c_contiguous)

# %%
# The classification head
# -----------------------
# The normalized CLS features ``[B, D]`` are projected by ``[D, D_embed]`` to the logits.
head = (rng.standard_normal((D, D_embed)) / np.sqrt(D)).astype(np.float32)
logits = cls_only @ head
print("logits shape:", logits.shape)
print("predicted classes:", logits.argmax(axis=1))
print("same logits from the full normalization:", np.array_equal(logits, full @ head))
