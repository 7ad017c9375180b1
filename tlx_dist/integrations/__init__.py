"""Integrations with other libraries. Each submodule imports its library lazily and says how to
install it when it is missing: ``tlx_dist.integrations.hf`` (Hugging Face ``transformers``,
``pip install tlx_dist[hf]``)."""
