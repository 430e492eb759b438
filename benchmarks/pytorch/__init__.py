"""Against plain PyTorch: a hand-written training loop, eager against ``torch.compile``, torch's and
transformers' default kernels, or the same update with one of our options off."""
