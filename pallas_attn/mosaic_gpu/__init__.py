"""Hopper (sm90) FlashAttention kernels in Pallas Mosaic GPU: forward, backward, custom_vjp."""
