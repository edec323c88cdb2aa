"""Integrations with other frameworks, each an optional extra, each imported on its own:

- ``fusedlayers.integrations.sdpa``: our attention as a flash-attention implementation of torch's SDPA.
- ``fusedlayers.integrations.transformers``: Hugging Face transformers models with our attention and fused
  causal-LM loss (``pip install "fusedlayers[transformers]"``).
- ``fusedlayers.integrations.thunder``: a Lightning Thunder executor claiming cross-entropy, softmax, attention,
  LayerNorm and RMSNorm
  (``pip install "fusedlayers[thunder]"``; lightning-thunder 0.2.6 needs torch 2.11, it does not import with 2.13).

This package imports nothing itself (``import fusedlayers`` never imports a framework); import the
submodule you need.
"""
