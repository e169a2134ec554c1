"""
Which axes are normalized
=========================

LayerNorm computes one mean and one variance per *group* of elements. Which elements
form a group is the only thing that differs between the usual layouts:

* ``(N, D)`` features: each row (the default, ``axis=-1``);
* ``(N, L, D)`` transformer activations: each token, over its ``D`` features;
* ``(N, C, H, W)`` with ``normalized_shape=(C, H, W)``: each whole sample;
* ``(N, C, H, W)`` with ``axis=1``: each pixel, over its ``C`` channels (ConvNeXt's
  "channels-first" LayerNorm).
"""

# %%
import matplotlib.pyplot as plt
import numpy as np

import layernorm as ln

rng = np.random.default_rng(0)

# %%
# ``(N, D)`` and ``(N, L, D)``: the last axis
# --------------------------------------------
x2 = rng.standard_normal((4, 6), dtype=np.float32)
y2, mean2, _ = ln.layer_norm(x2, return_stats=True)
print("(N, D):    mean shape", mean2.shape, "-> one mean per row")

x3 = rng.standard_normal((2, 5, 8), dtype=np.float32)
y3, mean3, _ = ln.layer_norm(x3, return_stats=True)
print("(N, L, D): mean shape", mean3.shape, "-> one mean per token")
print("token means after LayerNorm:", np.abs(y3.mean(axis=-1)).max().round(7), "(all ~0)")

# %%
# ``normalized_shape=(C, H, W)``: one group per sample
# -----------------------------------------------------
# This is :class:`torch.nn.LayerNorm`'s convention: ``normalized_shape`` names the
# trailing dimensions. ``weight`` and ``bias`` then have shape ``(C, H, W)``.
N, C, H, W = 2, 3, 4, 4
img = rng.standard_normal((N, C, H, W), dtype=np.float32)
y, mean, rstd = ln.layer_norm(img, normalized_shape=(C, H, W), return_stats=True)
print("mean shape", mean.shape, "-> one mean per sample")
print("per-sample means:", img.reshape(N, -1).mean(axis=1), "vs", mean.ravel())

# %%
# Channels: a transpose to channels-last, or ``axis=1``
# -----------------------------------------------------
# To normalize the ``C`` channels of every pixel of an NCHW image, PyTorch code moves the
# channels last, applies LayerNorm over the last axis and moves them back. ``axis=1``
# does the same without the two transposes; ``weight`` and ``bias`` have shape ``(C,)``.
w = np.linspace(0.5, 1.5, C, dtype=np.float32)
b = np.linspace(-1.0, 1.0, C, dtype=np.float32)

nhwc = img.transpose(0, 2, 3, 1)
via_transpose = ln.layer_norm(nhwc, weight=w, bias=b).transpose(0, 3, 1, 2)
direct, mean_c, _ = ln.layer_norm(img, axis=1, weight=w, bias=b, return_stats=True)

print("axis=1 mean shape", mean_c.shape, "-> one mean per pixel")
print("max |transpose - axis=1| =", np.abs(via_transpose - direct).max())
print("bitwise equal:", np.array_equal(via_transpose, direct))
assert np.array_equal(via_transpose, direct)

# %%
# The groups, drawn
# -----------------
# Each cell is one element, each colour one normalization group (one mean, one
# variance). Samples are separated by a black line; the 4-D arrays are drawn with
# ``C`` down and the ``H*W`` pixels across.


def groups(shape, axes):
    """Group id of every element: the index of its non-normalized coordinates."""
    keep = [a for a in range(len(shape)) if a not in axes]
    idx = np.indices(shape)
    kept_shape = [shape[a] for a in keep]
    return np.ravel_multi_index([idx[a] for a in keep], kept_shape)


cases = [
    ("(N, D), axis=-1", (4, 6), (1,), (4, 6), None, ("D", "N")),
    ("(N, L, D), axis=-1", (2, 3, 6), (2,), (6, 6), 3, ("D", "N x L")),
    (
        "(N, C, H, W),\nnormalized_shape=(C, H, W)",
        (2, 3, 2, 2),
        (1, 2, 3),
        (6, 4),
        3,
        ("H x W", "N x C"),
    ),
    ("(N, C, H, W), axis=1", (2, 3, 2, 2), (1,), (6, 4), 3, ("H x W", "N x C")),
]
fig, axs = plt.subplots(1, 4, figsize=(11, 3.4), layout="constrained")
for ax, (title, shape, axes, shown, sample_rows, (xl, yl)) in zip(axs, cases, strict=True):
    g = groups(shape, axes).reshape(shown)
    ax.imshow(g % 20, cmap="tab20", vmin=0, vmax=19)
    ax.set_xticks(np.arange(shown[1] + 1) - 0.5, minor=True)
    ax.set_yticks(np.arange(shown[0] + 1) - 0.5, minor=True)
    ax.grid(which="minor", color="white", linewidth=1.5)
    ax.tick_params(which="both", length=0, labelbottom=False, labelleft=False)
    if sample_rows:
        ax.axhline(sample_rows - 0.5, color="black", linewidth=2.5)
    ax.set_xlabel(xl)
    ax.set_ylabel(yl)
    ax.set_title(f"{title}\n{g.max() + 1} groups", fontsize=9)
fig.suptitle("Elements of one colour share one mean and one variance")
plt.show()
