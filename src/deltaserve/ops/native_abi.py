"""Constants and ctypes shorthands shared by the native-kernel bindings (the C side's limits)."""
import ctypes

MAX_ROWS = 8          # the kernels' DS_MAX_M: the small-M (decode) regime
AMX_ROWS = 64         # rows the AMX tile kernels take in one pass (batched decode)
GROUP_SIZE = 32
ACT_SILU, ACT_SITU = 0, 1
GATE_SIGMOID, GATE_SOFTPLUS = 0, 1
MLA_MAX_HEADS, MLA_MAX_RANK = 64, 1024   # ds_mla_decode's per-row score and merge buffers
P, I, L, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
