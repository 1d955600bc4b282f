"""nn.Module drop-ins built on the fused ops, one module per op family."""
