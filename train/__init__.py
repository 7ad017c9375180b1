"""Reference MoE pretraining loop on top of tlx_dist: model, parallelize (EP + FSDP2), data,
metrics, checkpoints. Entry point: ``python -m train.pretrain --config configs/<recipe>.toml``."""
