"""
Pre-norm and post-norm residual blocks
======================================

Where the LayerNorm sits in a residual block changes how a deep network behaves:

* **post-norm** (the original Transformer): ``x = LN(x + F(x))``, the residual stream is
  renormalized after every block;
* **pre-norm** (GPT-2, ViT, most modern models): ``x = x + F(LN(x))``, the stream itself
  is never normalized, only the input of each sub-layer; a final LayerNorm follows the
  last block.

Both written here in NumPy with :class:`layernorm.LayerNorm`, with a small MLP as ``F``.
"""

# %%
import matplotlib.pyplot as plt
import numpy as np

import layernorm as ln

rng = np.random.default_rng(0)
B, L, D, depth = 4, 32, 64, 24


class MLP:
    """F(x) = relu(x @ W1) @ W2, with He-initialised weights."""

    def __init__(self, d, hidden):
        self.w1 = (rng.standard_normal((d, hidden)) * np.sqrt(2 / d)).astype(np.float32)
        self.w2 = (rng.standard_normal((hidden, d)) * np.sqrt(2 / hidden)).astype(np.float32)

    def __call__(self, x):
        return np.maximum(x @ self.w1, 0) @ self.w2


class PostNormBlock:
    def __init__(self, d):
        self.f, self.norm = MLP(d, 4 * d), ln.LayerNorm(d)

    def __call__(self, x):
        return self.norm(x + self.f(x))


class PreNormBlock:
    def __init__(self, d):
        self.f, self.norm = MLP(d, 4 * d), ln.LayerNorm(d)

    def __call__(self, x):
        return x + self.f(self.norm(x))


post = [PostNormBlock(D) for _ in range(depth)]
pre = [PreNormBlock(D) for _ in range(depth)]
final_norm = ln.LayerNorm(D)
print(final_norm)

# %%
# Run both stacks and record the spread of the residual stream
# -------------------------------------------------------------
x0 = rng.standard_normal((B, L, D), dtype=np.float32)
stds = {"post-norm": [x0.std()], "pre-norm": [x0.std()]}
h_post, h_pre = x0, x0
for block_post, block_pre in zip(post, pre, strict=True):
    h_post, h_pre = block_post(h_post), block_pre(h_pre)
    stds["post-norm"].append(h_post.std())
    stds["pre-norm"].append(h_pre.std())
out_pre = final_norm(h_pre)
for name, s in stds.items():
    print(
        f"{name}: stream std after blocks 1, 6, 12, 24:",
        " ".join(f"{s[i]:.2f}" for i in (1, 6, 12, 24)),
    )
print(
    "pre-norm output after the final LayerNorm: std", out_pre.std().round(4), "dtype", out_pre.dtype
)

fig, ax = plt.subplots(figsize=(6, 3.5), layout="constrained")
for name, s in stds.items():
    ax.plot(range(depth + 1), s, "o-", label=name, markersize=3)
ax.set_xlabel("block")
ax.set_ylabel("std of the residual stream")
ax.set_yscale("log")
ax.legend()
ax.set_title("Post-norm renormalizes the stream; pre-norm lets it grow")
plt.show()

# %%
# Backward through one post-norm LayerNorm
# ----------------------------------------
# Each layer keeps the statistics of its last call, so ``backward`` gives the
# gradients of its input and of its parameters; the parameter gradients sum over
# every token of the batch (``B * L`` of them), in a fixed order.
norm = post[-1].norm
grad_out = rng.standard_normal(h_post.shape, dtype=np.float32)
grad_in, grad_weight, grad_bias = norm.backward(grad_out)
print(
    "grad_in:",
    grad_in.shape,
    grad_in.dtype,
    " grad_weight:",
    grad_weight.shape,
    " grad_bias:",
    grad_bias.shape,
)
print(
    "grad_bias == grad_out summed over batch and tokens:",
    np.allclose(grad_bias, grad_out.sum(axis=(0, 1)), rtol=1e-5, atol=1e-4),
)
print("state_dict keys (torch names):", list(norm.state_dict()))
