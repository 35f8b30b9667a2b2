"""Hand-written Triton kernels with their autograd Functions, for patterns whose backward is not a
derivation of the forward's ops (`splade_head`: the SPLADE head trained without its logits;
`linear_cross_entropy`: an LM head's loss and gradients without its logits)."""
