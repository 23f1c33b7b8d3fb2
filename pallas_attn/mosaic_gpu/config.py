"""Block sizes for the Mosaic GPU kernels (placeholder, filled in by the kernel work)."""
SUPPORTED_HEAD_DIMS = (64, 128, 256)
