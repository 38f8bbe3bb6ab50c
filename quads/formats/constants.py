"""Number-format constants, named after the specs (OCP MX v1.0 for E2M1/E4M3, NVIDIA NVFP4).

No bare 6.0, 448.0 or 2688.0 anywhere else in the code: import them from here.
"""

import torch

# E2M1 (FP4): 1 sign, 2 exponent, 1 mantissa bit; no inf/nan. Magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
F4_E2M1_MAX = 6.0
F4_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code c (0..7) -> magnitude; bit 3 is the sign

# E4M3 (FP8, "fn": no inf, one nan pattern). Max normal 448, min normal 2^-6, min subnormal 2^-9.
F8E4M3_MAX = 448.0
F8E4M3_MIN_NORMAL = 2.0**-6
F8E4M3_MIN_SUBNORMAL = 2.0**-9
F8E4M3_DTYPE = torch.float8_e4m3fn

# NVFP4: 16 elements share one E4M3 block scale; one FP32 scale per tensor (or per token).
NVFP4_BLOCK = 16
NVFP4_GLOBAL_ENCODE_NUMERATOR = F8E4M3_MAX * F4_E2M1_MAX  # 2688: S_enc = 2688 / amax

# FP32 limits used by the canonical (TransformerEngine) arithmetic.
FLT_MAX = float(torch.finfo(torch.float32).max)

# FP8 DeepSeek-style block sizes.
FP8_ACT_BLOCK = 128  # 1 x 128 activation blocks
FP8_WEIGHT_BLOCK = 128  # 128 x 128 weight blocks

# Swizzled (Blackwell tcgen05 / cuBLASLt) scale layout: 128 x 4 tiles of scale factors.
SWIZZLE_ROWS = 128
SWIZZLE_COLS = 4
