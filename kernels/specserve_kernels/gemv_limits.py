"""The limits gemv.py (the references and the dispatch) and gemv_triton.py (the kernel) share."""
import torch

MAX_ROWS = 16  # rows of x one launch takes (tl.dot's minimum tile height)
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP8_MIN_AMAX = 1e-12  # a row of zeros still gets a finite scale
