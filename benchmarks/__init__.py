"""asv benchmark suite of layernorm (see README.md in this folder)."""
