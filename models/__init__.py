"""The application around ``fusedlayers``: a GPT whose layers are picked by name (``models.layers``
registries), its LightningModule (``models.lit``), DataModule (``models.data``), callbacks, the training
run behind ``train.py`` (``models.training``), sweep comparison (``models.compare``) and sampling from a
checkpoint (``python -m models.sample``)."""
