"""Hand-written Triton kernels with their autograd Functions, for patterns whose backward is not a
derivation of the forward's ops (`splade_head`: the SPLADE head trained without its logits;
`linear_cross_entropy`: an LM head's loss and gradients without its logits), and what generated kernels
use at run time (`derived`: tensors computed from the weights, such as a BatchNorm folded into a conv)."""
