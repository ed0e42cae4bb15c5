"""Model folders and their loading: the product's checkpoint format and manifest, the embedded
default model, perturbations (weight noise, quantization, runtime logit noise) and the
checkpoints they write, compressed-tensors copies, model identities, and loading a pair into
torch."""
